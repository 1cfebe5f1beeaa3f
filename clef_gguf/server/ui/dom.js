// Small DOM helpers for the page's modules: text in, never markup. Everything the server or the user wrote reaches
// the page as text (textContent, text nodes).

export const $ = (id) => document.getElementById(id);

export function el(tag, props, ...children) {
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

export const shown = (value) => (typeof value === "string" ? value : JSON.stringify(value));
export const fixed = (p) => Number(p).toFixed(4); // the answers are rounded to 4 decimals: shown to all 4

let counter = 0;
export const uid = (what) => `${what}-${++counter}`;

export function labelled(labelText, input, extraClass) {
  input.id = input.id || uid("f");
  return el("div", { class: `field ${extraClass || ""}` }, el("label", { for: input.id, text: labelText }), input);
}
