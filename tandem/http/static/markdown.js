// Markdown to DOM nodes, for model output. Safe by construction: text only ever becomes
// text nodes (textContent), never HTML, and a link keeps its href only for http(s) and
// mailto. Covers what chat models write: headings, paragraphs, lists, quotes, rules,
// fenced code (also while the closing fence has not streamed in yet), simple tables, and
// inline code, bold, italic, strike-through and links.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const BULLET = /^(\s*)([-*+])\s+(.*)$/;
const ORDERED = /^(\s*)(\d{1,9})[.)]\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-{1,}:?\s*(\|\s*:?-{1,}:?\s*)*\|?\s*$/;

function el(tag, className, children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (children) node.append(...children);
  return node;
}

// Renders `source` into `target`, replacing what it held.
export function renderMarkdown(target, source) {
  target.replaceChildren(...blocks(source.replace(/\r\n?/g, "\n").split("\n")));
}

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    BULLET.test(line) || ORDERED.test(line) || isTableStart(line, next);
}

function isTableStart(line, next) {
  return line.includes("|") && next !== undefined && TABLE_RULE.test(next) && next.includes("-");
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      const fence = m[1];
      const body = [];
      i += 1;
      while (i < lines.length && !lines[i].trim().startsWith(fence)) body.push(lines[i++]);
      i += 1; // the closing fence, if it came
      out.push(codeBlock(m[2], body.join("\n")));
    } else if (!line.trim()) {
      i += 1;
    } else if ((m = line.match(HEADING))) {
      out.push(el(`h${Math.min(m[1].length + 2, 6)}`, "md-h", inline(m[2])));
      i += 1;
    } else if (RULE.test(line)) {
      out.push(el("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].replace(QUOTE, ""));
      out.push(el("blockquote", null, blocks(body)));
    } else if (BULLET.test(line) || ORDERED.test(line)) {
      i = list(lines, i, out);
    } else if (isTableStart(line, lines[i + 1])) {
      i = table(lines, i, out);
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && (para.length === 0 || !startsBlock(lines[i], lines[i + 1]))) {
        para.push(lines[i++].trim());
      }
      const children = [];
      para.forEach((text, k) => {
        if (k) children.push(el("br"));
        children.push(...inline(text));
      });
      out.push(el("p", null, children));
    }
  }
  return out;
}

function list(lines, i, out) {
  const ordered = ORDERED.test(lines[i]) && !BULLET.test(lines[i]);
  const pattern = ordered ? ORDERED : BULLET;
  const first = lines[i].match(pattern);
  const indent = first[1].length;
  const node = el(ordered ? "ol" : "ul");
  if (ordered && first[2] !== "1") node.start = Number(first[2]);
  while (i < lines.length) {
    // A blank line between two items keeps them in one list.
    if (!lines[i].trim() && (lines[i + 1] || "").match(pattern)?.[1].length === indent) i += 1;
    const m = lines[i].match(pattern);
    if (!m || m[1].length !== indent) break;
    const body = [m[3]];
    i += 1;
    // Lines indented past the marker belong to this item (continuations, nested lists),
    // and so does a blank line followed by one.
    while (i < lines.length) {
      const line = lines[i];
      const lead = line.search(/\S/);
      if (lead < 0) {
        if ((lines[i + 1] || "").search(/\S/) <= indent) break;
        body.push("");
      } else if (lead <= indent) {
        break;
      } else {
        body.push(line.slice(Math.min(lead, indent + 2)));
      }
      i += 1;
    }
    const inner = blocks(body);
    // A one-paragraph item shows its text without the paragraph's margins.
    if (inner.length && inner[0].tagName === "P") inner.splice(0, 1, ...inner[0].childNodes);
    node.append(el("li", null, inner));
  }
  out.push(node);
  return i;
}

function cells(line) {
  let text = line.trim();
  if (text.startsWith("|")) text = text.slice(1);
  if (text.endsWith("|") && !text.endsWith("\\|")) text = text.slice(0, -1);
  return text.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function table(lines, i, out) {
  const head = cells(lines[i]);
  const align = cells(lines[i + 1]).map((c) => (c.endsWith(":") ? (c.startsWith(":") ? "center" : "right") : "left"));
  const row = (values, tag) => el("tr", null, head.map((_, k) => {
    const cell = el(tag, null, inline(values[k] || ""));
    cell.style.textAlign = align[k] || "left";
    return cell;
  }));
  const body = [];
  i += 2;
  while (i < lines.length && lines[i].includes("|") && lines[i].trim()) body.push(row(cells(lines[i++]), "td"));
  out.push(el("div", "md-table", [el("table", null, [el("thead", null, [row(head, "th")]), el("tbody", null, body)])]));
  return i;
}

function codeBlock(lang, text) {
  const copy = el("button", "copy", ["Copy"]);
  copy.type = "button";
  copy.addEventListener("click", () => {
    if (!navigator.clipboard) return;
    navigator.clipboard.writeText(text).then(
      () => { copy.textContent = "Copied"; setTimeout(() => { copy.textContent = "Copy"; }, 1200); },
      () => { copy.textContent = "Copy failed"; },
    );
  });
  const code = el("code");
  code.textContent = text;
  if (lang) code.dataset.lang = lang;
  return el("div", "md-code", [el("div", "md-code-head", [el("span", null, [lang || "text"]), copy]), el("pre", null, [code])]);
}

// Inline spans. One pass over the text: the earliest match wins, its inside is parsed
// again (except code), the text between matches stays text.
const INLINE = new RegExp([
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source, // 1, 2: code
  /\*\*(?=\S)([\s\S]*?\S)\*\*/.source, // 3: strong
  /__(?=\S)([\s\S]*?\S)__(?!\w)/.source, // 4: strong
  /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source, // 5: emphasis
  /(?<![\w\\])_(?=\S)([\s\S]*?\S)_(?!\w)/.source, // 6: emphasis
  /~~(?=\S)([\s\S]*?\S)~~/.source, // 7: strike-through
  /\[([^\]\n]+)\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)/.source, // 8, 9: link
  /(https?:\/\/[^\s<>()]*[^\s<>().,:;!?"'\]])/.source, // 10: bare URL
].join("|"), "g");

const SAFE_URL = /^(https?:|mailto:)/i;

function link(text, href) {
  if (!SAFE_URL.test(href)) return typeof text === "string" ? [document.createTextNode(text)] : text;
  const a = el("a", null, typeof text === "string" ? [text] : text);
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  return [a];
}

export function inline(text) {
  const out = [];
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) out.push(document.createTextNode(text.slice(last, m.index)));
    last = m.index + m[0].length;
    if (m[2] !== undefined) {
      const code = el("code");
      code.textContent = m[2].length > 2 && m[2].startsWith(" ") && m[2].endsWith(" ") ? m[2].slice(1, -1) : m[2];
      out.push(code);
    } else if (m[3] !== undefined || m[4] !== undefined) {
      out.push(el("strong", null, inline(m[3] ?? m[4])));
    } else if (m[5] !== undefined || m[6] !== undefined) {
      out.push(el("em", null, inline(m[5] ?? m[6])));
    } else if (m[7] !== undefined) {
      out.push(el("del", null, inline(m[7])));
    } else if (m[8] !== undefined) {
      out.push(...link(inline(m[8]), m[9]));
    } else {
      out.push(...link(m[10], m[10]));
    }
  }
  if (last < text.length) out.push(document.createTextNode(text.slice(last)));
  return out;
}
