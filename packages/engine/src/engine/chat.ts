/**
 * Chat prompts: the model's jinja chat template (`tokenizer.chat_template` in the GGUF), rendered with
 * a well-kept jinja implementation (@huggingface/jinja). A model without a template gets llama.cpp's
 * fallback, ChatML.
 */
import { Template } from "@huggingface/jinja";
import type { GgufFile } from "@powerinfer/gguf";
import { EngineError } from "../errors.js";

export interface ChatMessage {
  role: "system" | "user" | "assistant" | (string & {});
  content: string;
  /** An assistant turn's tool calls, as templates that take tools read them (arguments as an object). */
  tool_calls?: { id?: string; type: "function"; function: { name: string; arguments: unknown } }[];
  /** A tool result's call id, and the tool's name. */
  tool_call_id?: string;
  name?: string;
}

/** llama.cpp's fallback when a model carries no template. */
export const CHATML_TEMPLATE =
  "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

export class ChatTemplate {
  private readonly template: Template;

  /**
   * @param source jinja source
   * @param isFallback true when the model had no template and ChatML is used
   * @throws EngineError 'BAD_INPUT' when the template does not parse.
   */
  constructor(
    readonly source: string,
    readonly isFallback: boolean,
    private readonly bosToken: string,
    private readonly eosToken: string,
  ) {
    try {
      this.template = new Template(source);
    } catch (e) {
      throw new EngineError("BAD_INPUT", `chat template does not parse: ${(e as Error).message}`);
    }
  }

  /** The model's template, or ChatML when it has none. */
  static fromGguf(file: GgufFile, bosToken: string, eosToken: string): ChatTemplate {
    const src = file.metadata.get("tokenizer.chat_template");
    return typeof src === "string" && src.length > 0
      ? new ChatTemplate(src, false, bosToken, eosToken)
      : new ChatTemplate(CHATML_TEMPLATE, true, bosToken, eosToken);
  }

  /**
   * Renders messages to prompt text (special tokens as text: tokenize it with parseSpecial).
   * @param extra further template variables, e.g. `tools` (OpenAI's tool list) for templates that take it
   * @throws EngineError 'BAD_INPUT' when rendering fails (e.g. the template raises on a role order).
   */
  apply(messages: ChatMessage[], addGenerationPrompt = true, extra: Record<string, unknown> = {}): string {
    try {
      return this.template.render({
        ...extra,
        messages,
        add_generation_prompt: addGenerationPrompt,
        bos_token: this.bosToken,
        eos_token: this.eosToken,
      });
    } catch (e) {
      throw new EngineError("BAD_INPUT", `chat template failed: ${(e as Error).message}`);
    }
  }
}
