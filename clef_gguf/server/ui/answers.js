// The answers: each question's options with their probabilities (two models side by side, and the change), usage.
import { $, el, fixed, shown } from "./dom.js";

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

export function showResults(questions, runs) {
  $("results").replaceChildren(...questions.map((q) => answerSection(q, runs)));
  showUsage(runs);
}

export function clearResults() {
  $("results").replaceChildren(el("p", { class: "muted", text: "No answer: see the message above." }));
  $("usage").hidden = true;
}

