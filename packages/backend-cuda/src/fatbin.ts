/**
 * Which GPU code an ELF file (an addon, a shared library) carries: the CUDA fat binaries in its
 * `.nv_fatbin` section, read without cuobjdump. Used by the tests and the device kit (apps/device-kit).
 *
 * A fat binary is a header (magic 0xBA55ED50, u16 version, u16 header size, u64 payload size) followed
 * by entries, each a header (u16 kind: 1 = PTX, 2 = ELF/SASS; u16 version; u32 header size; u64 payload
 * size; …; u32 SM number at byte 28) and its payload.
 */
import { readFileSync } from "node:fs";

export interface FatbinEntry {
  kind: "ptx" | "sass";
  /** The SM number, e.g. 90 for sm_90 / compute_90. */
  sm: number;
}

const FATBIN_MAGIC = 0xba55ed50;

/** The section's bytes, or undefined when the ELF has no such section. */
function elfSection(buf: Buffer, name: string): Buffer | undefined {
  if (buf.readUInt32BE(0) !== 0x7f454c46 || buf[4] !== 2 || buf[5] !== 1) return undefined; // ELF64 LE only
  const shoff = Number(buf.readBigUInt64LE(0x28));
  const shentsize = buf.readUInt16LE(0x3a);
  const shnum = buf.readUInt16LE(0x3c);
  const shstrndx = buf.readUInt16LE(0x3e);
  const sh = (i: number) => {
    const o = shoff + i * shentsize;
    return {
      name: buf.readUInt32LE(o),
      offset: Number(buf.readBigUInt64LE(o + 0x18)),
      size: Number(buf.readBigUInt64LE(o + 0x20)),
    };
  };
  const strtab = sh(shstrndx);
  for (let i = 0; i < shnum; i++) {
    const s = sh(i);
    const start = strtab.offset + s.name;
    const end = buf.indexOf(0, start);
    if (buf.toString("latin1", start, end) === name) return buf.subarray(s.offset, s.offset + s.size);
  }
  return undefined;
}

/** Every PTX and SASS entry of every fat binary in the ELF file at `path` (empty when none). */
export function fatbinEntries(path: string): FatbinEntry[] {
  const sec = elfSection(readFileSync(path), ".nv_fatbin");
  const out: FatbinEntry[] = [];
  if (!sec) return out;
  let p = 0;
  while (p + 16 <= sec.length) {
    if (sec.readUInt32LE(p) !== FATBIN_MAGIC) {
      p += 8; // containers are 8-byte aligned
      continue;
    }
    const headerSize = sec.readUInt16LE(p + 6);
    const size = Number(sec.readBigUInt64LE(p + 8));
    let e = p + headerSize;
    const end = Math.min(sec.length, e + size);
    while (e + 32 <= end) {
      const kind = sec.readUInt16LE(e);
      const entryHeader = sec.readUInt32LE(e + 4);
      const payload = Number(sec.readBigUInt64LE(e + 8));
      if (kind === 1 || kind === 2) out.push({ kind: kind === 1 ? "ptx" : "sass", sm: sec.readUInt32LE(e + 28) });
      if (entryHeader === 0) break;
      e += entryHeader + payload;
    }
    p = Math.max(p + 8, end);
  }
  return out;
}
