// The playground: one conversation streamed through /v1/chat/completions.

import { apiError, sseEvents, store } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const PARAMS_STORE = "tandem.params";
const DEFAULTS = { system: "", temperature: 0.7, maxTokens: 256, stop: "" };

export class Chat {
  constructor(api, root) {
    this.api = api;
    this.model = null;
    this.history = []; // {role, content} sent with the next request
    this.controller = null; // the stream in flight
    this.$ = (id) => root.querySelector(`#${id}`);
    this.messages = this.$("messages");
    this.prompt = this.$("prompt");
    this.send = this.$("send");
    this.send.disabled = true; // until the served model's id is known
    this.params = { ...DEFAULTS, ...store.get(PARAMS_STORE, {}) };
    this._bindParams();
    this.$("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      if (this.controller) this.controller.abort();
      else this.submit();
    });
    this.prompt.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        if (!this.controller) this.submit();
      }
    });
    this.prompt.addEventListener("input", () => this._grow());
    this.$("clear").addEventListener("click", () => this.clear());
  }

  setModel(id) {
    this.model = id;
    this.send.disabled = false;
  }

  _bindParams() {
    const fields = {
      system: this.$("p-system"),
      temperature: this.$("p-temperature"),
      maxTokens: this.$("p-max-tokens"),
      stop: this.$("p-stop"),
    };
    const out = this.$("p-temperature-out");
    const summary = this.$("params-summary");
    const show = () => {
      const p = this.params;
      out.textContent = Number(p.temperature).toFixed(2);
      const stops = stopList(p.stop).length;
      summary.textContent = `temperature ${Number(p.temperature).toFixed(2)} · max ${p.maxTokens} tokens` +
        (stops ? ` · ${stops} stop` : "") + (p.system.trim() ? " · system prompt" : "");
    };
    for (const [name, input] of Object.entries(fields)) {
      input.value = this.params[name];
      input.addEventListener("input", () => {
        this.params[name] = input.type === "range" || input.type === "number" ? input.valueAsNumber : input.value;
        store.set(PARAMS_STORE, this.params);
        show();
      });
    }
    show();
  }

  _grow() {
    this.prompt.style.height = "auto";
    this.prompt.style.height = `${Math.min(this.prompt.scrollHeight, 240)}px`;
  }

  clear() {
    if (this.controller) this.controller.abort();
    this.history = [];
    this.messages.replaceChildren(this.$("empty") || document.createElement("div"));
    this.$("empty").hidden = false;
    this.prompt.focus();
  }

  _bubble(role) {
    const empty = this.$("empty");
    if (empty) empty.hidden = true;
    const node = document.createElement("article");
    node.className = `msg ${role}`;
    node.dataset.role = role;
    const body = document.createElement("div");
    body.className = "body";
    node.append(body);
    this.messages.append(node);
    return { node, body };
  }

  _scroll() {
    const m = this.messages;
    if (m.scrollHeight - m.scrollTop - m.clientHeight < 160) m.scrollTop = m.scrollHeight;
  }

  _request() {
    const p = this.params;
    const messages = [];
    if (p.system.trim()) messages.push({ role: "system", content: p.system });
    messages.push(...this.history);
    const body = {
      model: this.model,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: Number.isFinite(p.temperature) ? p.temperature : DEFAULTS.temperature,
    };
    if (Number.isFinite(p.maxTokens) && p.maxTokens >= 1) body.max_tokens = Math.floor(p.maxTokens);
    const stop = stopList(p.stop);
    if (stop.length) body.stop = stop;
    return body;
  }

  async submit() {
    const text = this.prompt.value.trim();
    if (!text || !this.model) return;
    this.prompt.value = "";
    this._grow();
    this._bubble("user").body.textContent = text;
    this.history.push({ role: "user", content: text });
    const { node, body } = this._bubble("assistant");
    node.classList.add("streaming");
    const meta = document.createElement("div");
    meta.className = "meta";
    node.append(meta);
    this._scroll();

    this.controller = new AbortController();
    this.send.textContent = "Stop";
    this.send.classList.add("stop");
    let content = "";
    let usage = null;
    let finish = null;
    let firstAt = null;
    let pending = false;
    const started = performance.now();
    const paint = () => {
      pending = false;
      renderMarkdown(body, content);
      this._scroll();
    };
    try {
      const resp = await this.api.fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(this._request()),
        signal: this.controller.signal,
      });
      if (!resp.ok) throw await apiError(resp);
      for await (const event of sseEvents(resp)) {
        if (event.usage) usage = event.usage;
        const choice = event.choices && event.choices[0];
        if (!choice) continue;
        if (choice.finish_reason) finish = choice.finish_reason;
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          if (firstAt === null) firstAt = performance.now();
          content += delta;
          node.dataset.chunks = String(Number(node.dataset.chunks || 0) + 1);
          if (!pending) {
            pending = true;
            requestAnimationFrame(paint);
          }
        }
      }
    } catch (err) {
      if (err.name === "AbortError") finish = "stopped";
      else this._error(node, err);
    } finally {
      this.controller = null;
      this.send.textContent = "Send";
      this.send.classList.remove("stop");
      node.classList.remove("streaming");
      paint();
      if (content) this.history.push({ role: "assistant", content });
      else if (finish !== "stopped" && !node.querySelector(".error")) body.textContent = "(no text)";
      meta.textContent = describe(started, firstAt, usage, finish);
      node.dataset.finish = finish || "error";
    }
  }

  _error(node, err) {
    const box = document.createElement("div");
    box.className = "error";
    box.setAttribute("role", "alert");
    box.textContent = err.message || String(err);
    node.append(box);
    // A request that failed is not part of the conversation the model sees next.
    if (this.history.length && this.history[this.history.length - 1].role === "user") this.history.pop();
  }
}

function stopList(text) {
  return String(text || "").split("\n").filter((s) => s.length > 0).slice(0, 8);
}

function describe(started, firstAt, usage, finish) {
  const parts = [];
  if (usage) parts.push(`${usage.completion_tokens} tokens`);
  if (firstAt !== null) {
    parts.push(`first token ${Math.round(firstAt - started)} ms`);
    const span = (performance.now() - firstAt) / 1000;
    if (usage && usage.completion_tokens > 1 && span > 0) parts.push(`${((usage.completion_tokens - 1) / span).toFixed(1)} tok/s`);
  }
  if (usage && usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) {
    parts.push(`${usage.prompt_tokens_details.cached_tokens}/${usage.prompt_tokens} prompt tokens cached`);
  }
  if (finish) parts.push(finish === "length" ? "stopped at max tokens" : finish === "stopped" ? "stopped by you" : `finish: ${finish}`);
  return parts.join(" · ");
}
