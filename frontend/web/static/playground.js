// The playground at /: conversations kept in localStorage, answers streamed from
// /v1/chat/completions, a Stop that aborts the request, and the sampling settings.

import { api, ensureKey, errorText, forgetKey, needsKey } from "./api.js";
import { answerStats, requestBody, streamChat } from "./chat.js";
import { fillMessage, messageNode } from "./render.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const SETTING_FIELDS = { system: "system", temperature: "temperature", topP: "top-p",
  maxTokens: "max-tokens", extra: "extra" };
const state = { conversations: store.loadConversations(), current: null, controller: null,
  images: [] };

function showError(text) {
  $("error").textContent = text;
}

// ---- models and settings

async function loadModels() {
  const select = $("model");
  const response = await api("v1/models");
  if (!response.ok) return showError(`Could not list the models: ${await errorText(response)}`);
  const saved = store.loadSettings().model;
  for (const model of (await response.json()).data ?? []) {
    const option = document.createElement("option");
    option.value = model.id;
    const adapter = model.parent && model.parent !== model.id;
    option.textContent = adapter ? `${model.id} (LoRA on ${model.parent})` : model.id;
    select.append(option);
  }
  if ([...select.options].some((o) => o.value === saved)) select.value = saved;
}

function readSettings() {
  const settings = { model: $("model").value };
  for (const [key, id] of Object.entries(SETTING_FIELDS)) settings[key] = $(id).value;
  return settings;
}

function restoreSettings() {
  const saved = store.loadSettings();
  for (const [key, id] of Object.entries(SETTING_FIELDS)) {
    if (typeof saved[key] === "string") $(id).value = saved[key];
  }
}

// The extra fields' JSON object, or null (and the reason shown) when it is not one.
function extraFields(text) {
  if (!text.trim()) return {};
  try {
    const value = JSON.parse(text);
    if (value && typeof value === "object" && !Array.isArray(value)) return value;
  } catch {
    // reported below
  }
  showError("More request fields must be a JSON object, e.g. {\"seed\": 1}.");
  return null;
}

// ---- conversations

function save() {
  if (!store.saveConversations(state.conversations)) {
    showError("The browser's storage is full: this conversation is not kept.");
  }
}

function select(conversation) {
  state.current = conversation;
  renderList();
  renderMessages();
}

function renderList() {
  const list = $("conversations");
  list.replaceChildren();
  for (const c of [...state.conversations].sort((a, b) => b.updated - a.updated)) {
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title;
    if (c === state.current) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => select(c));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "icon";
    remove.textContent = "\u00d7";
    remove.setAttribute("aria-label", `Delete ${c.title}`);
    remove.addEventListener("click", () => removeConversation(c));
    const item = document.createElement("li");
    item.append(open, remove);
    list.append(item);
  }
}

function removeConversation(conversation) {
  state.conversations = state.conversations.filter((c) => c !== conversation);
  save();
  select(state.conversations[0] ?? newChat());
}

function newChat() {
  const conversation = store.newConversation();
  state.conversations.push(conversation);
  return conversation;
}

function renderMessages() {
  const section = $("messages");
  section.replaceChildren(...state.current.messages.map(messageNode));
  section.scrollTop = section.scrollHeight;
}

// ---- sending and stopping

async function send() {
  if (state.controller) return;  // one answer at a time
  const text = $("prompt").value;
  const settings = readSettings();
  const extra = extraFields(settings.extra);
  if ((!text.trim() && !state.images.length) || extra === null || !settings.model) return;
  showError("");
  store.saveSettings(settings);
  const conversation = state.current;
  const user = { role: "user", content: text, images: state.images };
  conversation.messages.push(user);
  if (conversation.title === "New chat") conversation.title = text.trim().slice(0, 40) || "Image";
  const body = requestBody({ ...settings, extra }, conversation.messages);
  const answer = { role: "assistant", content: "" };
  conversation.messages.push(answer);
  clearComposer();
  renderList();
  renderMessages();
  await runAnswer(conversation, body, answer);
}

async function runAnswer(conversation, body, answer) {
  const node = $("messages").lastElementChild;
  let queued = false;
  const redraw = () => {
    queued = false;
    fillMessage(node, answer);
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  state.controller = new AbortController();
  node.setAttribute("aria-busy", "true");  // screen readers read the answer once, when done
  setBusy(true);
  await streamChat(body, answer, () => {
    if (!queued) { queued = true; requestAnimationFrame(redraw); }
  }, state.controller.signal);
  answer.stats = answerStats(answer);
  delete answer.firstAt;
  conversation.updated = Date.now();
  state.controller = null;
  setBusy(false);
  redraw();
  node.removeAttribute("aria-busy");
  save();
}

function setBusy(busy) {
  $("stop").hidden = !busy;
  $("send").disabled = busy;
  document.body.classList.toggle("busy", busy);
  if (!busy) $("prompt").focus();
}

function clearComposer() {
  $("prompt").value = "";
  state.images = [];
  $("attachments").replaceChildren();
}

// ---- images

async function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const url = await new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
    state.images.push(url);
    const img = document.createElement("img");
    img.src = url;
    img.alt = file.name;
    $("attachments").append(img);
  }
}

// ---- wiring

function wire() {
  $("composer").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();  // Enter sends; Shift+Enter is a new line
      send();
    } else if (event.key === "Escape") {
      state.controller?.abort();  // as Stop
    }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", () => select(newChat()));
  $("image").addEventListener("change", (event) => {
    attach([...event.target.files]).catch((error) => showError(String(error)));
    event.target.value = "";
  });
  $("toggle-side").addEventListener("click", () => {
    const open = document.body.classList.toggle("side-open");
    $("toggle-side").setAttribute("aria-expanded", String(open));
  });
  $("forget-key").hidden = !needsKey();
  $("forget-key").addEventListener("click", () => { forgetKey(); location.reload(); });
}

async function main() {
  wire();
  restoreSettings();
  const latest = [...state.conversations].sort((a, b) => b.updated - a.updated)[0];
  select(latest ?? newChat());
  await ensureKey();
  await loadModels();
  document.body.dataset.ready = "true";
  $("prompt").focus();
}

main().catch((error) => showError(String(error?.message ?? error)));
