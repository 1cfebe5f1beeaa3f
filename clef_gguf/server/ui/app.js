// The page of `clef-gguf serve` (issue 56): ask a System One question, see each option's probability, compare two
// models, copy the request as code. Plain script, no build step, no other host. Everything the server or the user
// wrote reaches the page as text (textContent, text nodes): never as HTML.
"use strict";

(() => {
  const KEY_STORE = "clef-gguf-api-key"; // sessionStorage only: the key leaves with the tab
  const ALIAS = "jev-latest"; // /v1/models lists the SDKs' default name too: an alias of the base, not a model
  // The API's limits (docs/runtime.md, docs/images.md): the page stops adding there; the server refuses the rest.
  const LIMITS = { questions: 64, choice: 255, score: 10, images: 4, imageBytes: 4 << 20 };
  const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp"];
  const EXAMPLES = [
    {
      name: "Support ticket",
      state: { kind: "text", value: "My order arrived broken and nobody answers my emails. I want my money back today." },
      questions: [
        { id: "complaint", type: "noul", instructions: "Is the customer complaining?" },
        {
          id: "intent", type: "choice", instructions: "What does the customer want?",
          options: [["refund", "Money back"], ["replacement", "A new item"], ["information", ""]],
        },
        { id: "urgency", type: "score", instructions: "How urgent is it?", levels: ["low", "medium", "high"] },
      ],
    },
    {
      name: "Product review (JSON state)",
      state: { kind: "json", value: '{\n  "product": "kettle",\n  "stars": 2,\n  "review": "Boils fast but the lid broke in a week."\n}' },
      questions: [
        { id: "sentiment", type: "choice", instructions: "", options: [["positive", ""], ["mixed", ""], ["negative", ""]] },
        { id: "quality_issue", type: "noul", instructions: "Does the review report a defect?", truthy: "A part broke or failed" },
        { id: "recommend", type: "score", instructions: "Would the reviewer recommend it?", levels: ["no", "maybe", "yes"] },
      ],
    },
    {
      name: "Routing a message",
      state: { kind: "text", value: "Hi, can you move my 3pm meeting with Dana to Thursday?" },
      questions: [
        {
          id: "team", type: "choice", instructions: "Which assistant should handle this?",
          options: [["calendar", "Meetings and events"], ["email", "Writing and sending mail"], ["other", ""]],
        },
      ],
    },
  ];

  const $ = (id) => document.getElementById(id);
  const page = { base: "", names: [], images: [], imagesOn: false, counter: 0 };

  // ---- small DOM helpers: text in, never markup -------------------------------------------------------------------
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (name === "class") node.className = value;
      else if (name === "text") node.textContent = value;
      else if (name.startsWith("aria-") || name === "for" || name === "role" || name === "data-field") node.setAttribute(name, value);
      else node[name] = value;
    }
    for (const child of children) node.append(child instanceof Node ? child : String(child));
    return node;
  }
  const shown = (value) => (typeof value === "string" ? value : JSON.stringify(value));
  const fixed = (p) => Number(p).toFixed(4); // the answers are rounded to 4 decimals: shown to all 4

  // ---- the server ------------------------------------------------------------------------------------------------
  const apiKey = () => sessionStorage.getItem(KEY_STORE) || "";
  function headers(extra) {
    const all = { ...extra };
    if (apiKey()) all.Authorization = `Bearer ${apiKey()}`;
    return all;
  }
  async function call(path, init) {
    const response = await fetch(path, { ...init, headers: headers(init && init.headers), cache: "no-store" });
    const text = await response.text();
    let body = null;
    try { body = JSON.parse(text); } catch { body = null; }
    return { status: response.status, ok: response.ok, body, text, timing: response.headers.get("Server-Timing") || "" };
  }

  // The server's one-line message(s) of a refusal, each with the field it concerns where it names one.
  function refusals(result) {
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
    return [{ loc: [], message: `HTTP ${result.status}: ${result.text.slice(0, 200)}` }];
  }

  // ---- the key ---------------------------------------------------------------------------------------------------
  function askForKey(message) {
    $("key-section").hidden = false;
    $("key-error").textContent = message;
    $("key").focus();
  }
  $("key-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("key").value.trim());
    $("key").value = "";
    await loadModels();
  });

  // ---- models and the server's abilities -------------------------------------------------------------------------
  async function loadHealth() {
    const health = await call("/health");
    if (!health.ok || !health.body) {
      $("server").textContent = `The server did not answer /health (${health.status}).`;
      return;
    }
    page.base = String(health.body.model);
    page.imagesOn = health.body.images === true;
    $("server").textContent = `Serving ${page.base}: prompts up to ${health.body.max_prompt_tokens} tokens.`;
    $("drop").hidden = !page.imagesOn;
    $("images-note").textContent = page.imagesOn
      ? `Up to ${LIMITS.images} images (PNG, JPEG or WebP, each up to 4 MiB), placed before the state.`
      : "This server has no vision tower, so it takes no images: start it with `clef-gguf serve MODEL --mmproj MMPROJ` to send some.";
  }

  function fillModels(names) {
    page.names = names;
    for (const [select, pick] of [[$("model"), 0], [$("model-b"), Math.min(1, names.length - 1)]]) {
      const before = select.value;
      select.replaceChildren(...names.map((n) => el("option", { value: n, text: n === page.base ? `${n} (base)` : n })));
      select.value = names.includes(before) ? before : names[pick] || "";
    }
  }

  async function loadModels() {
    const listing = await call("/v1/models");
    if (!listing.ok) {
      fillModels(page.base ? [page.base] : []);
      const message = refusals(listing)[0].message;
      if (listing.status === 401) askForKey(message);
      else $("form-error").textContent = message;
      return;
    }
    $("key-section").hidden = true;
    $("key-error").textContent = "";
    const listed = (listing.body.models || []).map((m) => String(m.name)).filter((n) => n !== ALIAS);
    fillModels([page.base, ...listed.filter((n) => n !== page.base)].filter(Boolean));
  }

  $("compare-on").addEventListener("change", () => { $("model-b").disabled = !$("compare-on").checked; });

  // ---- questions -------------------------------------------------------------------------------------------------
  const uid = (what) => `${what}-${++page.counter}`;

  function labelled(labelText, input, extraClass) {
    input.id = input.id || uid("f");
    return el("div", { class: `field ${extraClass || ""}` }, el("label", { for: input.id, text: labelText }), input);
  }

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

  function optionsEditor(spec) {
    const box = el("div", { class: "options" });
    if (spec.type === "noul") {
      box.append(labelled("What true means (optional)", el("input", { type: "text", value: spec.truthy || "", className: "noul-true" })));
      box.append(labelled("What false means (optional)", el("input", { type: "text", value: spec.falsy || "", className: "noul-false" })));
      return box;
    }
    const kind = spec.type;
    const max = LIMITS[kind];
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
    list.addEventListener("click", (event) => {
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
      sync();
    });
    sync();
    box.append(list, add, el("p", { class: "muted", text: kind === "score" ? `2 to ${max} levels, lowest first.` : `2 to ${max} options.` }));
    return box;
  }

  function addQuestion(spec) {
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

  function syncQuestions() {
    $("add-question").disabled = $("questions").children.length >= LIMITS.questions;
  }

  $("add-question").addEventListener("click", () => {
    const type = $("new-type").value;
    const taken = new Set(readQuestions().map((q) => q.id));
    let n = taken.size + 1;
    while (taken.has(`q${n}`)) n += 1;
    addQuestion({ id: `q${n}`, type }).querySelector(".q-id").focus();
  });

  function loadExample(example) {
    document.querySelector(`input[name="state-kind"][value="${example.state.kind}"]`).checked = true;
    $("state").value = example.state.value;
    $("questions").replaceChildren();
    example.questions.forEach(addQuestion);
    clearErrors();
  }
  $("example").replaceChildren(...EXAMPLES.map((e, i) => el("option", { value: String(i), text: e.name })));
  $("load-example").addEventListener("click", () => loadExample(EXAMPLES[Number($("example").value)]));

  // ---- reading the form into a request ---------------------------------------------------------------------------
  function readQuestions() {
    return [...$("questions").children].map((item) => {
      const q = { id: item.querySelector(".q-id").value, type: item.dataset.type, item };
      q.instructions = item.querySelector(".q-instructions").value;
      if (q.type === "noul") {
        q.truthy = item.querySelector(".noul-true").value;
        q.falsy = item.querySelector(".noul-false").value;
      } else {
        q.options = [...item.querySelectorAll(".option")].map((row) => {
          const description = row.querySelector(".opt-description");
          return [row.querySelector(".opt-name").value, description ? description.value : ""];
        });
      }
      return q;
    });
  }

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

  // The request, or the fields the page itself can tell are wrong (the server judges everything else).
  function readRequest() {
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
      seen.add(q.id);
    }
    if (!questions.length) problems.push({ loc: ["questions"], message: "add at least one question" });
    const body = { state, questions: Object.fromEntries(questions.map((q) => [q.id, wireQuestion(q)])) };
    if (page.images.length) body.images = page.images.map((i) => i.url);
    return { body, questions, problems };
  }

  // ---- refusals next to their fields -----------------------------------------------------------------------------
  function clearErrors() {
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

  function showRefusals(list, questions, prefix) {
    const general = [];
    let first = null;
    for (const r of list) {
      const field = r.item ? { error: r.item.querySelector(".q-error"), input: r.item.querySelector(".q-id") } : fieldOf(r.loc, questions);
      const line = prefix ? `${prefix}: ${r.message}` : r.message;
      if (field) {
        field.error.textContent = field.error.textContent ? `${field.error.textContent}\n${line}` : line;
        field.input.setAttribute("aria-invalid", "true");
        first = first || field.input;
      }
      general.push(line);
    }
    // The summary is announced (role=alert); the same lines stay beside their fields.
    $("form-error").textContent = general.join("\n");
    if (first) first.focus();
  }

  // ---- images ----------------------------------------------------------------------------------------------------
  function renderImages() {
    $("image-list").replaceChildren(...page.images.map((image, i) => {
      const remove = el("button", { type: "button", text: "Remove", "aria-label": `Remove image ${image.name}` });
      remove.addEventListener("click", () => { page.images.splice(i, 1); renderImages(); $("image-input").focus(); });
      return el("li", {}, el("span", { text: `${image.name} (${Math.ceil(image.size / 1024)} KiB)` }), remove);
    }));
  }

  function addImages(files) {
    $("images-error").textContent = "";
    for (const file of files) {
      let why = "";
      if (page.images.length >= LIMITS.images) why = `at most ${LIMITS.images} images`;
      else if (!IMAGE_TYPES.includes(file.type)) why = "not a PNG, JPEG or WebP image";
      else if (file.size > LIMITS.imageBytes) why = "over 4 MiB";
      if (why) {
        $("images-error").textContent = `${file.name}: ${why}`;
        continue;
      }
      const entry = { name: file.name, size: file.size, url: "" };
      page.images.push(entry);
      const reader = new FileReader();
      reader.addEventListener("load", () => { entry.url = String(reader.result); });
      reader.readAsDataURL(file);
    }
    renderImages();
  }

  const drop = $("drop");
  drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    if (page.imagesOn) addImages([...event.dataTransfer.files]);
  });
  $("image-input").addEventListener("change", () => { addImages([...$("image-input").files]); $("image-input").value = ""; });

  // ---- answers ---------------------------------------------------------------------------------------------------
  // Each option's probability in the question's order: noul's true (its answer) and false, a choice's options, a
  // score's levels. JSON objects would list integer-like option names first: the order comes from the question.
  function optionsOf(q, answer) {
    if (!answer) return [];
    if (q.type === "noul") {
      const p = Number(answer.noul);
      return [["true", p], ["false", Math.round((1 - p) * 1e4) / 1e4]];
    }
    const probabilities = answer.probabilities || {};
    if (q.type === "choice") return q.options.map(([name]) => [name, Number(probabilities[name])]);
    return q.options.map(([level], i) => [level, Number(probabilities[String(i)])]);
  }

  function summaryOf(q, answer) {
    if (!answer) return "no answer";
    if (q.type === "noul") return `p(true) = ${fixed(answer.noul)}`;
    if (q.type === "choice") return `choice: ${shown(answer.choice)}, confidence ${fixed(answer.confidence)}`;
    return `score ${fixed(answer.score)} (0 = ${shown(q.options[0] && q.options[0][0])}), confidence ${fixed(answer.confidence)}`;
  }

  const topOf = (rows) => rows.reduce((best, row, i) => (row[1] > rows[best][1] ? i : best), 0);

  function bar(p) {
    const fill = el("span", { class: "fill" });
    fill.style.width = `${Math.max(0, Math.min(1, p)) * 100}%`; // CSSOM: allowed under a CSP without inline styles
    return el("span", { class: "bar", "aria-hidden": "true" }, fill);
  }

  function probabilityCell(p, isTop, model) {
    const line = el("div", { class: "prob-line" }, bar(p), el("span", { class: "value", text: fixed(p) }));
    if (isTop) line.append(el("span", { class: "badge", text: "top" }));
    const cell = el("td", { class: isTop ? "prob top" : "prob" }, line);
    cell.dataset.model = model;
    return cell;
  }

  function answerTable(q, runs) {
    const rows = runs.map((r) => optionsOf(q, r.body.answers && r.body.answers[q.id]));
    const tops = rows.map(topOf);
    const compare = runs.length > 1;
    const change = compare ? rows[0].map((row, i) => Math.round(((rows[1][i] || row)[1] - row[1]) * 1e4) / 1e4) : [];
    const largest = compare ? change.reduce((best, d, i) => (Math.abs(d) > Math.abs(change[best]) ? i : best), 0) : -1;
    const head = el("tr", {}, el("th", { scope: "col", text: q.type === "score" ? "Level" : "Option" }));
    runs.forEach((r) => head.append(el("th", { scope: "col", text: r.model })));
    if (compare) head.append(el("th", { scope: "col", text: "Change" }));
    const body = el("tbody");
    rows[0].forEach(([name], i) => {
      const tr = el("tr", {}, el("th", { scope: "row", text: shown(name) }));
      tr.dataset.option = shown(name);
      runs.forEach((r, m) => tr.append(probabilityCell(rows[m][i][1], tops[m] === i, r.model)));
      if (compare) {
        const d = change[i];
        const cell = el("td", { class: "change", text: `${d > 0 ? "+" : d < 0 ? "−" : "±"}${fixed(Math.abs(d))}` });
        if (i === largest && d !== 0) {
          tr.classList.add("largest");
          cell.append(el("span", { class: "badge", text: "largest change" }));
        }
        tr.append(cell);
      }
      body.append(tr);
    });
    const caption = el("caption", { class: "visually-hidden", text: `Probabilities for ${q.id}` });
    return el("table", { class: compare ? "answers compare" : "answers" }, caption, el("thead", {}, head), body);
  }

  function answerSection(q, runs) {
    const section = el("section", { class: "answer" }, el("h3", {}, q.id, " ", el("span", { class: "muted", text: q.type })));
    section.dataset.question = q.id;
    runs.forEach((r) => {
      const line = el("p", { class: "summary", text: summaryOf(q, r.body.answers && r.body.answers[q.id]) });
      if (runs.length > 1) line.prepend(el("strong", { text: `${r.model}: ` }));
      section.append(line);
    });
    section.append(answerTable(q, runs));
    return section;
  }

  // Server-Timing (read, queue, decide, back): the server's own time for the request, without the network's.
  function serverTime(header) {
    const parts = {};
    for (const metric of header.split(",")) {
      const [name, ...params] = metric.trim().split(";");
      for (const param of params) {
        const [k, v] = param.split("=");
        if (k.trim() === "dur") parts[name.trim()] = Number(v);
      }
    }
    const total = Object.values(parts).reduce((a, b) => a + b, 0);
    const each = Object.entries(parts).map(([n, d]) => `${n} ${d.toFixed(1)}`).join(", ");
    return Object.keys(parts).length ? `${total.toFixed(1)} ms (${each})` : "not reported";
  }

  function showUsage(runs) {
    const usage = $("usage");
    usage.replaceChildren();
    for (const r of runs) {
      const u = r.body.usage || {};
      const cached = (u.input_tokens_details || {}).cached_tokens;
      const group = el("div", { class: "usage-group" }, el("h3", { text: r.model }));
      group.dataset.model = r.model;
      for (const [term, value, key] of [
        ["Input tokens", u.input_tokens, "input"], ["Cached tokens", cached, "cached"], ["Server time", serverTime(r.timing), "time"],
      ]) {
        const dd = el("dd", { text: String(value ?? "–") });
        dd.dataset.usage = key;
        group.append(el("dt", { text: term }), dd);
      }
      usage.append(group);
    }
    usage.hidden = false;
  }

  function showResults(questions, runs) {
    $("results").replaceChildren(...questions.map((q) => answerSection(q, runs)));
    showUsage(runs);
  }

  function clearResults() {
    $("results").replaceChildren(el("p", { class: "muted", text: "No answer: see the message above." }));
    $("usage").hidden = true;
  }

  // ---- the request as code ---------------------------------------------------------------------------------------
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

  function showCode(body, needsKey) {
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
  for (const button of document.querySelectorAll("[data-copy]")) button.addEventListener("click", () => copy(button.dataset.copy));

  // ---- deciding --------------------------------------------------------------------------------------------------
  async function decide(model, body) {
    const result = await call("/v1/systemone", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ model, ...body }),
    });
    return { model, ...result };
  }

  $("ask").addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors();
    const { body, questions, problems } = readRequest();
    if (problems.length) { showRefusals(problems, questions, ""); return; }
    if (page.images.some((i) => !i.url)) { $("images-error").textContent = "an image is still being read: try again"; return; }
    const models = [$("model").value];
    if ($("compare-on").checked) models.push($("model-b").value);
    $("decide").disabled = true;
    $("busy").textContent = "Deciding…";
    try {
      const runs = await Promise.all(models.map((m) => decide(m, body)));
      showCode({ model: models[0], ...body }, apiKey() !== "" || runs.some((r) => r.status === 401));
      const refused = runs.filter((r) => !r.ok);
      if (refused.length) {
        // In a comparison each line names the model that refused.
        const named = (r, x) => (models.length > 1 ? { ...x, message: `${r.model}: ${x.message}` } : x);
        showRefusals(refused.flatMap((r) => refusals(r).map((x) => named(r, x))), questions, "");
        if (refused.some((r) => r.status === 401)) askForKey(refusals(refused.find((r) => r.status === 401))[0].message);
        clearResults();
        return;
      }
      showResults(questions, runs);
    } catch (e) {
      $("form-error").textContent = `The request did not reach the server: ${e.message}`;
    } finally {
      $("decide").disabled = false;
      $("busy").textContent = "";
    }
  });

  // ---- start -----------------------------------------------------------------------------------------------------
  loadExample(EXAMPLES[0]);
  loadHealth().then(loadModels).then(() => { document.body.dataset.ready = "true"; });
})();
