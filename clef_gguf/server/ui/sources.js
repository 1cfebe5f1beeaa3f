// Adapters from a source (serve --adapter-source hf://ORG): a name the server fetches on its first use, typed beside
// the list of the models it serves already. The server says which names it may fetch (/ui/limits.json's `sources`,
// the Hub organisations or repositories it was given: never a token or a folder of its own).
import { $ } from "./dom.js";
import { page } from "./page.js";

const shape = (prefix) => (prefix.includes("/") ? `${prefix}[@REVISION]` : `${prefix}/REPO[@REVISION]`);

export function wireSources() {
  const prefixes = (page.limits && page.limits.sources) || [];
  $("source-field").hidden = prefixes.length === 0;
  $("source-names").textContent = prefixes.map(shape).join(", ");
  $("model-source").placeholder = prefixes.length ? shape(prefixes[0]) : "";
  $("model-source").addEventListener("input", () => { $("model").disabled = $("model-source").value.trim() !== ""; });
}

// The model asked: a name typed from a source, else the one picked in the list.
export function chosenModel() {
  return $("model-source").value.trim() || $("model").value;
}

// What the page says while a decision waits: a name not listed yet is fetched (and a checkpoint converted) first.
export function waitingNote(models) {
  const fetched = models.filter((m) => m !== page.base && !(m in page.listed));
  if (!fetched.length) return "Deciding…";
  return `Fetching ${fetched.join(", ")} for its first use, then deciding… (the request waits)`;
}

// When to ask again, after a refusal's message, as its Retry-After says (a source unreachable, or still fetching).
export function retryNote(result) {
  return result.retryAfter ? ` Ask again in ${result.retryAfter} s.` : "";
}
