// Calls to this server's API: relative URLs (so the pages work under --root-path) and, where
// the server wants --api-key's key (<html data-auth="key">), the key the user typed, kept in
// sessionStorage for this tab only.

const KEY = "sluice.apiKey";

export function needsKey() {
  return document.documentElement.dataset.auth === "key";
}

export function hasKey() {
  return Boolean(sessionStorage.getItem(KEY));
}

export function forgetKey() {
  sessionStorage.removeItem(KEY);
}

function withKey(headers = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...headers, Authorization: `Bearer ${key}` } : { ...headers };
}

// Resolves once a key is stored: at once when the server needs none or one is kept.
export async function ensureKey() {
  if (needsKey() && !hasKey()) await askKey("This server needs an API key.");
}

// A modal form (built here, so both pages share it); the key never leaves this tab.
export function askKey(message) {
  return new Promise((resolve) => {
    const dialog = document.createElement("dialog");
    dialog.className = "key-dialog";
    const form = document.createElement("form");
    const note = document.createElement("p");
    note.textContent = message;
    const label = document.createElement("label");
    label.htmlFor = "api-key";
    label.textContent = "API key";
    const input = document.createElement("input");
    Object.assign(input, { id: "api-key", type: "password", required: true, autocomplete: "off" });
    const button = document.createElement("button");
    button.type = "submit";
    button.textContent = "Use key";
    form.append(note, label, input, button);
    dialog.append(form);
    dialog.addEventListener("cancel", (event) => event.preventDefault());  // no key, no page
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, input.value.trim());
      dialog.close();
      dialog.remove();
      resolve();
    });
    document.body.append(dialog);
    dialog.showModal();
    input.focus();
  });
}

// fetch() with the key; a refused key is asked for again and the call repeated once.
export async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: withKey(options.headers) });
  if (response.status === 401 && needsKey() && !options.signal?.aborted) {
    forgetKey();
    await askKey("The server refused that key; try another.");
    return fetch(path, { ...options, headers: withKey(options.headers) });
  }
  return response;
}

// The error message of an OpenAI-shaped error body, or the status line.
export async function errorText(response) {
  try {
    const body = await response.json();
    if (body?.error?.message) return `${response.status}: ${body.error.message}`;
  } catch {
    // not JSON: the status says enough
  }
  return `${response.status} ${response.statusText}`.trim();
}
