// The page of `clef-gguf serve`: ask a System One question, see each option's probability, compare two models,
// copy the request as code. ES modules served by the server itself: no build step, no other host. Everything the
// server or the user wrote reaches the page as text (dom.js), never as HTML.
import { clearResults, showResults } from "./answers.js";
import { showCode, wireCopy } from "./code.js";
import { $, el } from "./dom.js";
import { EXAMPLES } from "./examples.js";
import { imagesNote, wireImages } from "./images.js";
import { page } from "./page.js";
import { addQuestion, newQuestion } from "./questions.js";
import { clearErrors, readRequest, showRefusals } from "./request.js";
import { apiKey, askForKey, call, decide, keyProblem, loadLimits, refusals, storeKey } from "./server.js";
import { chosenModel, retryNote, waitingNote, wireSources } from "./sources.js";

// ---- the key: one the browser can send, or refused at the form and never stored -----------------------------------
$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const key = $("key").value.trim();
  const problem = keyProblem(key);
  if (problem) {
    $("key-error").textContent = problem;
    $("key").setAttribute("aria-invalid", "true");
    $("key").focus();
    return;
  }
  $("key").removeAttribute("aria-invalid");
  storeKey(key);
  $("key").value = "";
  await loadModels();
});

// ---- models and the server's abilities -----------------------------------------------------------------------------
async function loadHealth() {
  const health = await call("/health");
  if (!health.ok || !health.body) {
    $("server").textContent = `The server did not answer /health (${health.status || refusals(health)[0].message}).`;
    return;
  }
  page.base = String(health.body.model);
  page.imagesOn = health.body.images === true;
  $("server").textContent = `Serving ${page.base}: prompts up to ${health.body.max_prompt_tokens} tokens.`;
  $("drop").hidden = !page.imagesOn;
  $("images-note").textContent = imagesNote();
  $("drop-text").textContent = `Drop up to ${page.limits.images} images (PNG, JPEG, WebP) here, or`;
}

// The second model of a comparison is never preselected as the first: the first other name it may ask.
function otherModel() {
  const other = page.names.find((n) => n !== $("model").value && askable(n));
  if ($("model-b").value === $("model").value && other !== undefined) $("model-b").value = other;
}

// Each model's state, as /v1/models says it: an adapter loaded, on disk (loaded when asked), or refused (and why).
const STATES = { resident: "resident", on_disk: "on disk", refused: "refused" };
const askable = (n) => (page.listed[n] || {}).state !== "refused";

function modelOption(n) {
  const listed = page.listed[n] || {};
  const state = STATES[listed.state] ? listed.state : "";
  const text = n === page.base ? `${n} (base)` : state ? `${n} · ${STATES[state]}` : n;
  const option = el("option", { value: n, text, disabled: state === "refused" });
  if (listed.reason) option.title = String(listed.reason);
  option.dataset.state = state;
  return option;
}

function fillModels(names) {
  page.names = names;
  for (const select of [$("model"), $("model-b")]) {
    const before = select.value;
    select.replaceChildren(...names.map(modelOption));
    select.value = names.includes(before) && askable(before) ? before : names.find(askable) || "";
  }
  otherModel();
}

async function loadModels() {
  const listing = await call("/v1/models");
  if (!listing.ok) {
    page.listed = {};
    fillModels(page.base ? [page.base] : []);
    const message = refusals(listing)[0].message;
    if (listing.status === 401) askForKey(message);
    else $("form-error").textContent = message;
    return;
  }
  $("key-section").hidden = true;
  $("key-error").textContent = "";
  const models = (listing.body.models || []).filter((m) => String(m.name) !== page.limits.alias);
  page.listed = Object.fromEntries(models.map((m) => [String(m.name), m]));
  const listed = models.map((m) => String(m.name));
  fillModels([page.base, ...listed.filter((n) => n !== page.base)].filter(Boolean));
}

$("model").addEventListener("change", otherModel);
$("compare-on").addEventListener("change", () => { $("model-b").disabled = !$("compare-on").checked; });

// ---- questions and examples ----------------------------------------------------------------------------------------
function loadExample(example) {
  document.querySelector(`input[name="state-kind"][value="${example.state.kind}"]`).checked = true;
  $("state").value = example.state.value;
  $("questions").replaceChildren();
  example.questions.forEach(addQuestion);
  clearErrors();
}
$("add-question").addEventListener("click", newQuestion);
$("example").replaceChildren(...EXAMPLES.map((e, i) => el("option", { value: String(i), text: e.name })));
$("load-example").addEventListener("click", () => loadExample(EXAMPLES[Number($("example").value)]));

// ---- deciding ------------------------------------------------------------------------------------------------------
async function decideAll(models, body, questions) {
  const runs = await Promise.all(models.map((m) => decide(m, body)));
  showCode({ model: models[0], ...body }, apiKey() !== "" || runs.some((r) => r.status === 401));
  const refused = runs.filter((r) => !r.ok);
  if (!refused.length) {
    showResults(questions, runs);
    return;
  }
  // In a comparison each line names the model that refused; a refusal for now (503) says when to ask again.
  const named = (r, x) => ({ ...x, message: `${models.length > 1 ? `${r.model}: ` : ""}${x.message}${retryNote(r)}` });
  showRefusals(refused.flatMap((r) => refusals(r).map((x) => named(r, x))), questions);
  if (refused.some((r) => r.status === 401)) askForKey(refusals(refused.find((r) => r.status === 401))[0].message);
  clearResults();
}

$("ask").addEventListener("submit", async (event) => {
  event.preventDefault();
  if ($("decide").disabled) return; // a decision is on its way (Ctrl+Enter again)
  clearErrors();
  const { body, questions, problems } = readRequest();
  if (problems.length) { showRefusals(problems, questions); return; }
  if (page.images.some((i) => !i.url)) { $("images-error").textContent = "an image is still being read: try again"; return; }
  const models = [chosenModel()];
  if ($("compare-on").checked) models.push($("model-b").value);
  $("decide").disabled = true;
  $("busy").textContent = waitingNote(models);
  try {
    await decideAll(models, body, questions);
  } finally {
    $("decide").disabled = false;
    $("busy").textContent = "";
  }
  await loadModels(); // the states again: the adapter asked is resident now, another may have been unloaded
});

// Ctrl+Enter (Cmd+Enter) decides from anywhere in the form, however long it is; the Decide bar also stays in view.
$("ask").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
    event.preventDefault();
    $("ask").requestSubmit();
  }
});

// ---- start ---------------------------------------------------------------------------------------------------------
async function start() {
  try {
    page.limits = await loadLimits();
  } catch (e) {
    $("server").textContent = `The page cannot start: ${e.message}.`;
    return;
  }
  wireImages();
  wireCopy();
  wireSources();
  loadExample(EXAMPLES[0]);
  await loadHealth();
  await loadModels();
}
start().finally(() => { document.body.dataset.ready = "true"; });
