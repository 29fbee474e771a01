// The edge's HTTP API as the console uses it: the API key, error bodies, SSE streams.

const KEY_STORE = "tandem.apiKey";

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export class Api {
  constructor() {
    this.key = readStore(KEY_STORE) || "";
    // Called on a 401 with the reason; resolves to a key to retry with, or null to give up.
    // Concurrent 401s (a poll and a chat message) share one prompt.
    this.askKey = null;
    this._asking = null;
    this.declined = false; // the user cancelled the prompt: no more prompts until a key is set
  }

  setKey(key) {
    this.key = key || "";
    this.declined = false;
    writeStore(KEY_STORE, this.key || null);
  }

  // fetch() that adds the key and, on a 401, asks for one and tries again.
  async fetch(path, init = {}) {
    let wrong = false;
    for (;;) {
      const headers = { ...(init.headers || {}) };
      if (this.key) headers.Authorization = `Bearer ${this.key}`;
      const resp = await fetch(path, { ...init, headers });
      if (resp.status !== 401 || !this.askKey || this.declined) return resp;
      const key = await this._ask(wrong || Boolean(this.key));
      if (key === null) return resp;
      wrong = true;
    }
  }

  _ask(wasWrong) {
    if (!this._asking) {
      this._asking = this.askKey(wasWrong).then((key) => {
        this._asking = null;
        if (key !== null) this.setKey(key);
        else this.declined = true;
        return key;
      });
    }
    return this._asking;
  }

  // Asks for a key before the first call when the edge says it needs one (no 401 first).
  async ensureKey() {
    let settings = {};
    try {
      const resp = await fetch("/console/settings.json");
      if (resp.ok) settings = await resp.json();
    } catch {
      // an older edge or a network hiccup: the first 401 asks instead
    }
    if (settings.api_key_required && !this.key && this.askKey) await this._ask(false);
  }

  async json(path, init) {
    const resp = await this.fetch(path, init);
    if (!resp.ok) throw await apiError(resp);
    return resp.json();
  }
}

// The OpenAI-shaped error body's message, or the status line when there is none.
export async function apiError(resp) {
  let message = `${resp.status} ${resp.statusText}`.trim();
  let code;
  try {
    const body = await resp.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code;
    }
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(resp.status, message, code);
}

// Server-sent events of an OpenAI stream: yields each JSON payload until [DONE].
export async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (!data) continue; // a keep-alive comment
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.error) throw new ApiError(500, event.error.message || "the stream failed", event.error.code);
        yield event;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function readStore(key) {
  try {
    return localStorage.getItem(key);
  } catch {
    return null; // storage disabled: the console still works, it just forgets
  }
}

function writeStore(key, value) {
  try {
    if (value === null) localStorage.removeItem(key);
    else localStorage.setItem(key, value);
  } catch {
    // storage disabled
  }
}

export const store = {
  get(key, fallback) {
    const raw = readStore(key);
    if (raw === null) return fallback;
    try {
      return JSON.parse(raw);
    } catch {
      return fallback;
    }
  },
  set(key, value) {
    writeStore(key, JSON.stringify(value));
  },
};
