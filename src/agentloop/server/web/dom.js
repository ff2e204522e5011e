// Small DOM helpers shared by the page and the process view.
//
// One rule keeps model output harmless: text from the model, from tools and from users reaches
// the page only through textContent (el() below), never innerHTML, so an answer holding markup
// is shown as markup and never becomes elements. The server's Content-Security-Policy (no inline
// script) is the second line of defence.

export const $ = (id) => document.getElementById(id);

/** An element with a class and text; the only way text gets into the page. */
export function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

export const pretty = (value) => (typeof value === "string" ? value : JSON.stringify(value, null, 2));
export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** The text of message content blocks (images and documents as a placeholder). */
export function textOf(blocks) {
  const shown = (b) => {
    if (b.type === "text") return b.text;
    if (b.type === "image") return "[image]";
    if (b.type === "file") return `[file ${b.name || b.mimeType}]`;
    return "";
  };
  return (blocks || []).map(shown).join("");
}

export function status(text) {
  $("status").textContent = text;
}

export function scrollDown() {
  const t = $("transcript");
  t.scrollTop = t.scrollHeight;
}
