// The server, as the page speaks to it: the key (the tab's session storage only), calls, refusals, and what the
// server says of itself (/health, /v1/models, /ui/limits.json): nothing here is a copy of the server's own numbers.
import { $ } from "./dom.js";

const KEY_STORE = "clef-gguf-api-key"; // sessionStorage only: the key leaves with the tab

// The server's own rule for a key (server/app.check_api_key): visible ASCII. A browser cannot send a header with a
// character outside Latin-1 at all (fetch throws), and the server matches no key with a space or a control character.
export function keyProblem(key) {
  if (!key) return "the key is empty";
  if (![...key].every((c) => c >= "!" && c <= "~")) {
    return "the key must be visible ASCII characters (no spaces, no control or non-ASCII characters)";
  }
  return "";
}

export function apiKey() {
  const key = sessionStorage.getItem(KEY_STORE) || "";
  if (key && keyProblem(key)) sessionStorage.removeItem(KEY_STORE); // stored by an older page: it could never be sent
  return keyProblem(key) ? "" : key;
}
export const storeKey = (key) => sessionStorage.setItem(KEY_STORE, key);

export async function call(path, init) {
  const all = { ...(init && init.headers) };
  if (apiKey()) all.Authorization = `Bearer ${apiKey()}`;
  let response;
  try {
    response = await fetch(path, { ...init, headers: all, cache: "no-store" });
  } catch (e) {
    const text = `the request did not reach the server: ${e.message}`;
    return { status: 0, ok: false, body: null, text, timing: "", retryAfter: "" };
  }
  const text = await response.text();
  let body = null;
  try { body = JSON.parse(text); } catch { body = null; }
  const headers = response.headers;
  return {
    status: response.status, ok: response.ok, body, text,
    timing: headers.get("Server-Timing") || "", retryAfter: headers.get("Retry-After") || "",
  };
}

// The server's one-line message(s) of a refusal, each with the field it concerns where it names one.
export function refusals(result) {
  const detail = result.body && result.body.detail;
  if (Array.isArray(detail)) {
    return detail.map((d) => {
      const loc = Array.isArray(d.loc) ? d.loc.map(String) : [];
      const path = loc[0] === "body" ? loc.slice(1) : loc;
      return { loc: path, message: path.length ? `${path.join(".")}: ${d.msg}` : String(d.msg) };
    });
  }
  if (detail && typeof detail === "object" && detail.message) return [{ loc: [], message: String(detail.message) }];
  if (typeof detail === "string") return [{ loc: [], message: detail }];
  if (result.status === 0) return [{ loc: [], message: result.text }];
  return [{ loc: [], message: `HTTP ${result.status}: ${result.text.slice(0, 200)}` }];
}

export function askForKey(message) {
  $("key-section").hidden = false;
  $("key-error").textContent = message;
  $("key").focus();
}

// The API's limits and the SDKs' alias, as the server that serves the page has them (server/ui.py).
export async function loadLimits() {
  const limits = await call("/ui/limits.json");
  if (!limits.ok || !limits.body) throw new Error(`the server did not answer /ui/limits.json (${limits.status})`);
  return limits.body;
}

export async function decide(model, body) {
  const result = await call("/v1/systemone", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ model, ...body }),
  });
  return { model, ...result };
}
