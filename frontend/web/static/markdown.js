// A small Markdown renderer that builds DOM nodes, never HTML text: every character of the
// source ends up in a text node, and the only elements are the ones made here (paragraphs,
// headings, lists, quotes, code blocks, inline code, bold, italic, http(s) links).

const FENCE = /^\s*(```+|~~~+)\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const LIST_ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const BLANK = /^\s*$/;
// One inline span; its groups, in order: `code`, **bold**, __bold__, *italic*, [text](url).
const INLINE = new RegExp([
  /(`+)([^`][\s\S]*?)\1(?!`)/.source,
  /\*\*(?=\S)([\s\S]*?\S)\*\*/.source,
  /__(?=\S)([\s\S]*?\S)__/.source,
  /\*(?=[^\s*])([^*]*?[^\s*])\*/.source,
  /\[([^\]\n]+)\]\(([^)\s]+)\)/.source,
].join("|"));

function el(tag, children = [], props = {}) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  node.append(...children);
  return node;
}

export function renderMarkdown(source) {
  const fragment = document.createDocumentFragment();
  const lines = String(source).replace(/\r\n?/g, "\n").split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (BLANK.test(line)) i += 1;
    else if (FENCE.test(line)) i = codeBlock(lines, i, fragment);
    else if (HEADING.test(line)) i = heading(lines, i, fragment);
    else if (LIST_ITEM.test(line)) i = list(lines, i, fragment);
    else if (QUOTE.test(line)) i = quote(lines, i, fragment);
    else i = paragraph(lines, i, fragment);
  }
  return fragment;
}

// Up to the closing fence, or to the end while the answer is still streaming.
function codeBlock(lines, start, out) {
  const [, fence, lang] = FENCE.exec(lines[start]);
  let end = start + 1;
  while (end < lines.length && !lines[end].trim().startsWith(fence)) end += 1;
  const code = el("code", [lines.slice(start + 1, end).join("\n")]);
  if (lang) code.dataset.lang = lang;
  const pre = el("pre", [code]);
  out.append(pre);
  return end + 1;
}

function heading(lines, start, out) {
  const [, marks, text] = HEADING.exec(lines[start]);
  out.append(el(`h${Math.min(marks.length + 2, 6)}`, inline(text)));
  return start + 1;
}

function list(lines, start, out) {
  const ordered = /\d/.test(LIST_ITEM.exec(lines[start])[1]);
  const node = el(ordered ? "ol" : "ul");
  let i = start;
  let item = null;
  while (i < lines.length && !BLANK.test(lines[i]) && !FENCE.test(lines[i])) {
    const match = LIST_ITEM.exec(lines[i]);
    if (match) {
      item = el("li", inline(match[2]));
      node.append(item);
    } else {
      item.append(" ", ...inline(lines[i].trim()));  // a wrapped item's next line
    }
    i += 1;
  }
  out.append(node);
  return i;
}

function quote(lines, start, out) {
  let i = start;
  const quoted = [];
  while (i < lines.length && QUOTE.test(lines[i])) quoted.push(QUOTE.exec(lines[i++])[1]);
  out.append(el("blockquote", [renderMarkdown(quoted.join("\n"))]));
  return i;
}

function paragraph(lines, start, out) {
  let i = start;
  const text = [];
  while (i < lines.length && !BLANK.test(lines[i]) && !FENCE.test(lines[i])
         && !HEADING.test(lines[i]) && !LIST_ITEM.test(lines[i]) && !QUOTE.test(lines[i])) {
    text.push(lines[i++]);
  }
  out.append(el("p", inline(text.join("\n"))));
  return i;
}

// Text and the inline spans in it, as nodes.
export function inline(text) {
  const nodes = [];
  let rest = text;
  for (let match = INLINE.exec(rest); match; match = INLINE.exec(rest)) {
    if (match.index) nodes.push(document.createTextNode(rest.slice(0, match.index)));
    nodes.push(span(match));
    rest = rest.slice(match.index + match[0].length);
  }
  if (rest) nodes.push(document.createTextNode(rest));
  return nodes;
}

function span(match) {
  const [whole, , code, bold, bold2, italic, linkText, href] = match;
  if (code !== undefined) return el("code", [code]);
  if (bold !== undefined || bold2 !== undefined) return el("strong", inline(bold ?? bold2));
  if (italic !== undefined) return el("em", inline(italic));
  const url = safeUrl(href);
  if (!url) return document.createTextNode(whole);  // javascript:, data: ...: shown as text
  return el("a", inline(linkText), { href: url, target: "_blank", rel: "noopener noreferrer" });
}

// Only absolute http(s) URLs become links.
export function safeUrl(href) {
  try {
    const url = new URL(href);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}
