// The console's entry point: theme, tabs, the API key dialog, and the two views.

import { Api, store } from "./api.js";
import { Chat } from "./chat.js";
import { Cluster } from "./cluster.js";

const THEME_STORE = "tandem.theme";

function setupTheme() {
  const root = document.documentElement;
  const prefersDark = window.matchMedia("(prefers-color-scheme: dark)").matches;
  root.dataset.theme = store.get(THEME_STORE, prefersDark ? "dark" : "light");
  document.getElementById("theme-button").addEventListener("click", () => {
    root.dataset.theme = root.dataset.theme === "dark" ? "light" : "dark";
    store.set(THEME_STORE, root.dataset.theme);
  });
}

function setupTabs() {
  const layout = document.querySelector(".layout");
  const tabs = document.querySelectorAll("[data-tab][role=tab]");
  for (const tab of tabs) {
    tab.addEventListener("click", () => {
      layout.dataset.tab = tab.dataset.tab;
      for (const t of tabs) t.setAttribute("aria-selected", String(t === tab));
    });
  }
}

// The key dialog: resolves to the key entered, or null when cancelled.
function setupKeyDialog(api) {
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  const reason = document.getElementById("key-reason");
  let settle = null;
  const finish = (value) => {
    if (dialog.open) dialog.close();
    if (settle) settle(value);
    settle = null;
  };
  document.getElementById("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    finish(input.value.trim() || null);
  });
  document.getElementById("key-cancel").addEventListener("click", () => finish(null));
  document.getElementById("key-forget").addEventListener("click", () => {
    api.setKey("");
    input.value = "";
    finish(null);
  });
  dialog.addEventListener("cancel", () => finish(null));
  const open = (text) => new Promise((resolve) => {
    settle = resolve;
    reason.textContent = text;
    input.value = "";
    dialog.showModal();
    input.focus();
  });
  api.askKey = (wasWrong) => open(wasWrong
    ? "The server did not accept that API key. Enter another one."
    : "This server requires an API key. It is kept in this browser only.");
  document.getElementById("key-button").addEventListener("click", () => {
    if (dialog.open) return;
    open(api.key ? "An API key is saved in this browser. Replace or forget it." : "Set the API key this browser sends.")
      .then((key) => { if (key !== null) api.setKey(key); });
    // (Cancelling here changes nothing; Forget clears the saved key.)
  });
}

async function loadModel(api, chat) {
  const chip = document.getElementById("model");
  for (let delay = 1000; ; delay = Math.min(delay * 2, 15000)) {
    try {
      const body = await api.json("/v1/models");
      const id = body.data && body.data[0] && body.data[0].id;
      if (id) {
        chip.textContent = id;
        chat.setModel(id);
        return;
      }
    } catch (err) {
      chip.textContent = err.status === 401 ? "API key needed" : "model unknown";
    }
    await new Promise((r) => setTimeout(r, delay));
  }
}

function showReady(state) {
  const pill = document.getElementById("ready");
  pill.dataset.ok = String(state.ok);
  pill.textContent = state.text;
}

setupTheme();
setupTabs();
const api = new Api();
setupKeyDialog(api);
const chat = new Chat(api, document);
const cluster = new Cluster(api, document, { onReady: showReady });
await api.ensureKey();
loadModel(api, chat);
cluster.start();
