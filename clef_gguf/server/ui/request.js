// The form read into a System One request, and refusals (the page's own and the server's) shown beside their fields.
import { $ } from "./dom.js";
import { page } from "./page.js";
import { readQuestions } from "./questions.js";

function wireQuestion(q) {
  const wire = { type: q.type };
  if (q.instructions.trim()) wire.instructions = q.instructions;
  if (q.type === "noul") {
    const criteria = {};
    if (q.truthy.trim()) criteria.true = q.truthy;
    if (q.falsy.trim()) criteria.false = q.falsy;
    if (Object.keys(criteria).length) wire.criteria = criteria;
  } else if (q.type === "choice") {
    wire.criteria = Object.fromEntries(q.options.map(([name, d]) => [name, d.trim() ? d : null]));
  } else {
    wire.criteria = q.options.map(([name]) => name);
  }
  return wire;
}

// A choice's options are the keys of an object: two options of one name would reach the server as one (and be shown
// as two rows). Refused here, at the field and in the server's words (runtime/prompt.py), as it refuses an empty name.
function optionProblems(q) {
  if (q.type !== "choice") return [];
  const where = `questions.${q.id}.criteria`;
  const empty = q.options.find(([name]) => !name);
  if (empty) return [{ loc: ["questions", q.id], item: q.item, input: empty[2], message: `${where}: option names must not be empty` }];
  const seen = new Set();
  for (const [name, , input] of q.options) {
    if (seen.has(name)) {
      const message = `${where}: the option ${JSON.stringify(name)} is named twice; each option needs a name of its own`;
      return [{ loc: ["questions", q.id], item: q.item, input, message }];
    }
    seen.add(name);
  }
  return [];
}

// The request, or the fields the page itself can tell are wrong (the server judges everything else).
export function readRequest() {
  const problems = [];
  let state = $("state").value;
  if (document.querySelector('input[name="state-kind"]:checked').value === "json") {
    try { state = JSON.parse(state); } catch (e) { problems.push({ loc: ["state"], message: `state: not JSON (${e.message})` }); }
  }
  const questions = readQuestions();
  const seen = new Set();
  for (const q of questions) {
    if (!q.id) problems.push({ loc: ["questions", q.id], item: q.item, message: "a question needs an id" });
    else if (seen.has(q.id)) problems.push({ loc: ["questions", q.id], item: q.item, message: `two questions have the id ${q.id}` });
    else problems.push(...optionProblems(q));
    seen.add(q.id);
  }
  if (!questions.length) problems.push({ loc: ["questions"], message: "add at least one question" });
  const body = { state, questions: Object.fromEntries(questions.map((q) => [q.id, wireQuestion(q)])) };
  if (page.images.length) body.images = page.images.map((i) => i.url);
  return { body, questions, problems };
}

export function clearErrors() {
  for (const node of document.querySelectorAll(".field-error, #form-error")) node.textContent = "";
  for (const node of document.querySelectorAll("[aria-invalid]")) node.removeAttribute("aria-invalid");
}

function fieldOf(loc, questions) {
  const [head, id] = loc;
  if (head === "model" || head === "lora") return { error: $("model-error"), input: $("model") };
  if (head === "state") return { error: $("state-error"), input: $("state") };
  if (head === "images" || head === "assets") return { error: $("images-error"), input: $("image-input") };
  if (head === "questions") {
    const q = questions.find((x) => x.id === String(id));
    if (q) return { error: q.item.querySelector(".q-error"), input: q.item.querySelector(".q-id") };
    return { error: $("questions-error"), input: $("add-question") };
  }
  return null;
}

export function showRefusals(list, questions) {
  const general = [];
  let first = null;
  for (const r of list) {
    const field = r.item ? { error: r.item.querySelector(".q-error"), input: r.input || r.item.querySelector(".q-id") } : fieldOf(r.loc, questions);
    if (field) {
      field.error.textContent = field.error.textContent ? `${field.error.textContent}\n${r.message}` : r.message;
      field.input.setAttribute("aria-invalid", "true");
      first = first || field.input;
    }
    general.push(r.message);
  }
  // The summary is announced (role=alert); the same lines stay beside their fields.
  $("form-error").textContent = general.join("\n");
  if (first) first.focus();
}
