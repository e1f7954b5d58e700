// Conversations and settings in the browser's localStorage. What is read back is checked
// here and rendered as text elsewhere: storage is as untrusted as model output.

const CONVERSATIONS = "sluice.conversations";
const SETTINGS = "sluice.settings";

function read(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key) ?? "null");
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return true;
  } catch {
    return false;  // over the quota (large images): the page says so
  }
}

function validMessage(m) {
  return m && typeof m === "object" && ["system", "user", "assistant", "tool"].includes(m.role)
    && typeof (m.content ?? "") === "string";
}

export function loadConversations() {
  const list = read(CONVERSATIONS, []);
  if (!Array.isArray(list)) return [];
  return list.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages))
    .map((c) => ({ ...c, title: String(c.title ?? "Chat"),
      messages: c.messages.filter(validMessage) }));
}

export function saveConversations(list) {
  return write(CONVERSATIONS, list);
}

export function newConversation() {
  const id = globalThis.crypto?.randomUUID?.() ?? `${Date.now()}-${Math.random()}`;
  return { id, title: "New chat", messages: [], updated: Date.now() };
}

export function loadSettings() {
  const settings = read(SETTINGS, {});
  return settings && typeof settings === "object" ? settings : {};
}

export function saveSettings(settings) {
  write(SETTINGS, settings);
}
