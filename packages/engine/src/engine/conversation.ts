/**
 * A conversation over one session, with llama.cpp's context shifting: the KV cache is reused for the prefix a
 * turn shares with the last, and when the context is full the oldest turns are dropped (the system message
 * stays) and the conversation is evaluated again from there. The CLI's `chat` drives it; any front end can.
 */
import { EngineError } from "../errors.js";
import type { ChatMessage, ChatTemplate } from "./chat.js";
import type { GeneratedToken, GenerateOptions, Timings } from "./generation.js";

/** What a chat needs from a session (an engine `Session`). */
export interface ChatSession {
  readonly nCtx: number;
  nPast: number;
  readonly timings: Timings;
  generate(prompt: readonly number[], opts: GenerateOptions): AsyncGenerator<GeneratedToken>;
}

export interface ChatSettings {
  system?: string;
  /** Most tokens per reply; −1 = until end of turn. */
  nPredict: number;
  /** Sampling options of every reply. */
  sampling: GenerateOptions;
}

/** Where a chat writes: the reply text (stdout), one-line notices (stderr). */
export interface ChatOutput {
  text(s: string): void;
  notice(line: string): void;
  /** Whether the reply text goes to a terminal (a notice in the middle of a reply then starts on a new line). */
  readonly terminal?: boolean;
}

function plural(n: number, what: string): string {
  return `${n} ${what}${n === 1 ? "" : "s"}`;
}

/**
 * A conversation over one session. The KV cache is reused for the prefix a turn shares with the last;
 * when the context is full, the oldest turns are dropped (the system message stays) and the conversation
 * is evaluated again from there, as llama.cpp's interactive mode shifts its context.
 */
export class Chat {
  /** The system message (when given), then user/assistant turns. */
  readonly messages: ChatMessage[];
  private readonly first: number;
  /** Tokens the session's KV cache holds, in order. */
  private cached: number[] = [];
  private abort: AbortController | undefined;
  /** Room a reply should have when a turn starts; older turns are dropped to make it. */
  private readonly reserve: number;

  /** @throws EngineError 'PROMPT_TOO_LONG' when the system prompt alone fills the context. */
  constructor(
    private readonly session: ChatSession,
    private readonly tokenize: (text: string) => number[],
    private readonly template: ChatTemplate,
    private readonly settings: ChatSettings,
    private readonly out: ChatOutput,
  ) {
    this.messages = settings.system ? [{ role: "system", content: settings.system }] : [];
    this.first = this.messages.length;
    const nCtx = session.nCtx;
    const n = this.ids([...this.messages, { role: "user", content: "" }]).length;
    if (n >= nCtx) {
      // without a system message the tokens are the template's framing of an empty user turn
      const what = settings.system ? "the system prompt" : "the chat template's framing of an empty turn";
      throw new EngineError(
        "PROMPT_TOO_LONG",
        `${what} takes ${n} tokens of the ${nCtx}-token context (n_ctx); use a larger -c`,
      );
    }
    this.reserve = settings.nPredict >= 0 ? Math.min(settings.nPredict, Math.floor(nCtx / 2)) : Math.floor(nCtx / 4);
  }

  /** Stops the reply being written (Ctrl+C); false when none is. */
  interrupt(): boolean {
    if (!this.abort) return false;
    this.abort.abort();
    return true;
  }

  /** Answers one user message, writing the reply as it is generated. */
  async turn(content: string): Promise<void> {
    const { session, out, settings } = this;
    const nCtx = session.nCtx;
    // a message that does not fit even after every older turn is refused before any turn is dropped
    const alone = this.ids([...this.messages.slice(0, this.first), { role: "user", content }]).length;
    if (alone >= nCtx) {
      out.notice(
        `message not sent: ${this.first ? "with the system prompt " : ""}it takes ${alone} tokens, the context holds ${nCtx} (n_ctx); use a larger -c`,
      );
      return;
    }
    this.messages.push({ role: "user", content });
    let ids = this.ids();
    let dropped = 0;
    while (ids.length + this.reserve > nCtx && this.canDrop) {
      dropped += this.dropOldest();
      ids = this.ids();
    }
    // dropping stops at the message alone (shorter than the context, checked above) at the latest
    if (dropped > 0) out.notice(this.fullNotice(dropped, ""));
    this.abort = new AbortController();
    let reply = "";
    const replyIds: number[] = [];
    try {
      for (;;) {
        const p = commonPrefix(this.cached, ids);
        session.nPast = p;
        const before = replyIds.length;
        for await (const t of session.generate(ids.slice(p), {
          ...settings.sampling,
          maxTokens: settings.nPredict < 0 ? -1 : settings.nPredict - replyIds.length,
          signal: this.abort.signal,
        })) {
          if (t.id >= 0) replyIds.push(t.id);
          reply += t.text;
          out.text(t.text);
        }
        this.cached = [...ids, ...replyIds.slice(before)].slice(0, session.nPast);
        if (session.timings.stopReason !== "context") break;
        if (settings.nPredict >= 0 && replyIds.length >= settings.nPredict) break;
        // the context filled in the middle of the reply: drop older turns and go on with it
        let n = 0;
        let next = ids;
        while (this.canDrop) {
          n += this.dropOldest();
          next = [...this.ids(), ...replyIds];
          if (next.length + Math.min(this.reserve, 16) <= nCtx) break;
        }
        if (n === 0 || next.length >= nCtx) {
          out.text("\n");
          out.notice(
            `context full (n_ctx ${nCtx}): the reply is cut; this turn alone fills the context${
              n > 0 ? ` (dropped the ${plural(n, "oldest message")})` : ""
            }`,
          );
          this.messages.push({ role: "assistant", content: reply });
          return;
        }
        if (out.terminal) out.text("\n"); // piped output keeps the reply whole
        out.notice(this.fullNotice(n, "; the reply goes on"));
        ids = next;
      }
    } finally {
      this.abort = undefined;
    }
    out.text("\n");
    this.messages.push({ role: "assistant", content: reply });
  }

  /** Token ids of `messages` followed by the assistant's generation prompt. */
  private ids(messages: ChatMessage[] = this.messages): number[] {
    return this.tokenize(this.template.apply(messages));
  }

  /** Whether a message older than the user's current one can be dropped. */
  private get canDrop(): boolean {
    return this.messages.length - this.first > 1;
  }

  /** Drops the oldest turn (a user message and the reply to it); the system message stays. */
  private dropOldest(): number {
    const n = Math.min(2, this.messages.length - this.first - 1);
    this.messages.splice(this.first, n);
    return n;
  }

  private fullNotice(dropped: number, then: string): string {
    return `context full (n_ctx ${this.session.nCtx}): dropped the ${plural(dropped, "oldest message")}${
      this.first ? " (the system prompt is kept)" : ""
    }${then}`;
  }
}

/** Length of the common prefix of `a` and `b`, leaving at least one token of `b` to evaluate. */
function commonPrefix(a: readonly number[], b: readonly number[]): number {
  let p = 0;
  while (p < a.length && p < b.length - 1 && a[p] === b[p]) p++;
  return p;
}
