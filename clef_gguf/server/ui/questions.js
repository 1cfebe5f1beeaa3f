// The questions' editor: noul, choice and score questions, their options or levels, within the server's limits.
import { $, el, labelled, uid } from "./dom.js";
import { page } from "./page.js";

function optionRow(kind, list, name, description) {
  const row = el("li", { class: "option" });
  const nameInput = el("input", { type: "text", value: name || "", className: "opt-name", spellcheck: false });
  row.append(labelled(kind === "choice" ? "Option" : "Level", nameInput));
  if (kind === "choice") {
    const describe = el("input", { type: "text", value: description || "", className: "opt-description" });
    row.append(labelled("Description (optional)", describe));
  }
  const tools = el("div", { class: "option-tools" });
  if (kind === "score") {
    tools.append(el("button", { type: "button", text: "Up", className: "opt-up", "aria-label": "Move level up" }));
    tools.append(el("button", { type: "button", text: "Down", className: "opt-down", "aria-label": "Move level down" }));
  }
  tools.append(el("button", { type: "button", text: "Remove", className: "opt-remove", "aria-label": `Remove ${kind === "choice" ? "option" : "level"}` }));
  row.append(tools);
  list.append(row);
  return row;
}

function noulEditor(spec, box) {
  box.append(labelled("What true means (optional)", el("input", { type: "text", value: spec.truthy || "", className: "noul-true" })));
  box.append(labelled("What false means (optional)", el("input", { type: "text", value: spec.falsy || "", className: "noul-false" })));
  return box;
}

function moveOrRemove(event, add) {
  const button = event.target.closest("button");
  if (!button) return;
  const row = button.closest("li");
  if (button.classList.contains("opt-remove")) {
    (row.nextElementSibling || row.previousElementSibling || add).querySelector?.("input")?.focus();
    row.remove();
  } else if (button.classList.contains("opt-up") && row.previousElementSibling) {
    row.previousElementSibling.before(row);
    button.focus();
  } else if (button.classList.contains("opt-down") && row.nextElementSibling) {
    row.nextElementSibling.after(row);
    button.focus();
  }
}

function optionsEditor(spec) {
  const box = el("div", { class: "options" });
  if (spec.type === "noul") return noulEditor(spec, box);
  const kind = spec.type;
  const [min, max] = page.limits[kind]; // the server's own range of options (levels)
  const list = el(kind === "score" ? "ol" : "ul", { class: "option-list", "aria-label": kind === "score" ? "Levels, lowest first" : "Options" });
  const rows = kind === "score" ? (spec.levels || ["low", "high"]).map((l) => [l, ""]) : spec.options || [["yes", ""], ["no", ""]];
  rows.forEach(([name, description]) => optionRow(kind, list, name, description));
  const add = el("button", { type: "button", text: kind === "score" ? "Add level" : "Add option", className: "opt-add" });
  const sync = () => { add.disabled = list.children.length >= max; };
  add.addEventListener("click", () => {
    const row = optionRow(kind, list, "", "");
    sync();
    row.querySelector("input").focus();
  });
  list.addEventListener("click", (event) => { moveOrRemove(event, add); sync(); });
  sync();
  const range = kind === "score" ? `${min} to ${max} levels, lowest first.` : `${min} to ${max} options.`;
  box.append(list, add, el("p", { class: "muted", text: range }));
  return box;
}

export function syncQuestions() {
  $("add-question").disabled = $("questions").children.length >= page.limits.questions;
}

export function addQuestion(spec) {
  const item = $("question-template").content.firstElementChild.cloneNode(true);
  item.dataset.type = spec.type;
  item.querySelector(".q-legend").textContent = `${spec.type} question`;
  const id = item.querySelector(".q-id");
  const instructions = item.querySelector(".q-instructions");
  const error = item.querySelector(".q-error");
  id.id = uid("qid");
  instructions.id = uid("qins");
  error.id = uid("qerr");
  item.querySelector(".q-id-label").htmlFor = id.id;
  item.querySelector(".q-instructions-label").htmlFor = instructions.id;
  id.setAttribute("aria-describedby", error.id);
  id.value = spec.id;
  instructions.value = spec.instructions || "";
  instructions.placeholder = "Empty: the id is the instructions";
  item.querySelector(".q-options").append(optionsEditor(spec));
  item.querySelector(".q-remove").addEventListener("click", () => {
    item.remove();
    syncQuestions();
    $("add-question").focus();
  });
  $("questions").append(item);
  syncQuestions();
  return item;
}

// Each question as the form holds it: its id, type, instructions, and options (name, description, input).
export function readQuestions() {
  return [...$("questions").children].map((item) => {
    const q = { id: item.querySelector(".q-id").value, type: item.dataset.type, item };
    q.instructions = item.querySelector(".q-instructions").value;
    if (q.type === "noul") {
      q.truthy = item.querySelector(".noul-true").value;
      q.falsy = item.querySelector(".noul-false").value;
    } else {
      q.options = [...item.querySelectorAll(".option")].map((row) => {
        const description = row.querySelector(".opt-description");
        const name = row.querySelector(".opt-name");
        return [name.value, description ? description.value : "", name];
      });
    }
    return q;
  });
}

export function newQuestion() {
  const type = $("new-type").value;
  const taken = new Set(readQuestions().map((q) => q.id));
  let n = taken.size + 1;
  while (taken.has(`q${n}`)) n += 1;
  addQuestion({ id: `q${n}`, type }).querySelector(".q-id").focus();
}
