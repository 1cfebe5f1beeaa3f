// The request just sent, as code: curl, Python with typesafe-sdk, and the JSON body, each with a Copy button.
import { $ } from "./dom.js";

const shellQuote = (s) => `'${s.replace(/'/g, "'\\''")}'`;

// A Python literal of a JSON value: JSON's string escapes are Python's too.
function py(value) {
  if (value === null) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value === "number" || typeof value === "string") return JSON.stringify(value);
  if (Array.isArray(value)) return `[${value.map(py).join(", ")}]`;
  return `{${Object.entries(value).map(([k, v]) => `${JSON.stringify(k)}: ${py(v)}`).join(", ")}}`;
}

function pyQuestion(id, q) {
  const args = [];
  // The SDK's Noul wants instructions or a described outcome. Without either, the server takes the id as the
  // instructions (docs/runtime.md): the snippet says so, and the prompt is the same.
  const instructions = q.type === "noul" && q.instructions === undefined && q.criteria === undefined ? id : q.instructions;
  if (instructions !== undefined) args.push(`instructions=${py(instructions)}`);
  if (q.criteria !== undefined) args.push(`criteria=${py(q.criteria)}`);
  return `${{ noul: "Noul", choice: "Choice", score: "Score" }[q.type]}(${args.join(", ")})`;
}

function pythonOf(body) {
  const types = [...new Set(Object.values(body.questions).map((q) => ({ noul: "Noul", choice: "Choice", score: "Score" })[q.type]))];
  const lines = ["import os", "", `from typesafe_sdk import ${[...types.sort(), "TypeSafeClient"].join(", ")}`, "", "questions = {"];
  for (const [id, q] of Object.entries(body.questions)) lines.push(`    ${JSON.stringify(id)}: ${pyQuestion(id, q)},`);
  lines.push("}", `key = os.environ.get("CLEF_GGUF_API_KEY", "local")  # any key, unless the server has --api-key`);
  lines.push(`with TypeSafeClient(base_url=${JSON.stringify(location.origin)}, api_key=key) as client:`);
  lines.push("    response = client.system_one(", `        state=${py(body.state)},`, "        questions=questions,");
  lines.push(`        model=${py(body.model)},`);
  // Images go in the body's `images`, as the page sends them (the SDK's assets would add references to the state).
  if (body.images) lines.push(`        extra_body={"images": ${py(body.images)}},`);
  lines.push("    )", "print(response.model_dump_json(indent=2))");
  return lines.join("\n");
}

export function showCode(body, needsKey) {
  const json = JSON.stringify(body, null, 2);
  const curl = [`curl -sS ${shellQuote(`${location.origin}/v1/systemone`)}`, "-H 'Content-Type: application/json'"];
  if (needsKey) curl.push('-H "Authorization: Bearer $CLEF_GGUF_API_KEY"');
  curl.push(`--data-binary ${shellQuote(json)}`);
  $("code-curl").textContent = curl.join(" \\\n  ");
  $("code-python").textContent = pythonOf(body);
  $("code-json").textContent = json;
  $("code").hidden = false;
}

async function copy(id) {
  const text = $(id).textContent;
  try {
    await navigator.clipboard.writeText(text);
    $("copied").textContent = "Copied.";
  } catch {
    // No clipboard permission: the text is selected, for Ctrl+C.
    const range = document.createRange();
    range.selectNodeContents($(id));
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    $("copied").textContent = "Selected: press Ctrl+C to copy.";
  }
}
export function wireCopy() {
  for (const button of document.querySelectorAll("[data-copy]")) button.addEventListener("click", () => copy(button.dataset.copy));
}
