// A small markdown renderer for replies: headings, paragraphs, rules, blockquotes (nested), lists
// (nested, ordered or not, tight or loose), GitHub tables with alignment, fenced code with syntax
// highlighting, and inline code, bold, italic, strikethrough and http(s) links. Every piece of the
// model's text is HTML-escaped before any markup is added, so HTML in a reply shows as text, never runs.
"use strict";

import { escapeHtml, highlight } from "./syntax.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*)$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])(?:\s+(.*)|$)/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

export function renderMarkdown(source) {
  return blocks(source.replace(/\r\n?/g, "\n").replace(/\t/g, "    ").split("\n"), false);
}

const leading = (line) => line.match(/^ */)[0].length;

function isTableStart(lines, i) {
  return lines[i].includes("|") && i + 1 < lines.length && lines[i + 1].includes("|") && TABLE_RULE.test(lines[i + 1]);
}

function startsBlock(lines, i) {
  const line = lines[i];
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line)
    || isTableStart(lines, i);
}

// lines -> HTML; `tight`: paragraphs without <p> (the items of a list with no blank line in it)
function blocks(lines, tight) {
  const html = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (!line.trim()) i++;
    else if ((match = line.match(FENCE))) i = fence(lines, i, match, html);
    else if ((match = line.match(HEADING))) {
      const level = match[1].length;
      html.push(`<h${level}>${inline(match[2].replace(/\s+#+\s*$/, ""))}</h${level}>`);
      i++;
    } else if (RULE.test(line)) { html.push("<hr>"); i++; }
    else if (QUOTE.test(line)) i = quote(lines, i, html);
    else if (ITEM.test(line)) i = list(lines, i, html);
    else if (isTableStart(lines, i)) i = table(lines, i, html);
    else i = paragraph(lines, i, html, tight);
  }
  return html.join("");
}

function fence(lines, i, [, marker, language], html) {
  const indent = leading(lines[i]);
  const closing = new RegExp(`^\\s*${marker[0] === "`" ? "`" : "~"}{${marker.length},}\\s*$`);
  const code = [];
  for (i++; i < lines.length && !closing.test(lines[i]); i++) code.push(lines[i].slice(Math.min(indent, leading(lines[i]))));
  const attribute = language ? ` class="language-${escapeHtml(language)}"` : "";
  html.push(`<pre><code${attribute}>${highlight(code.join("\n"), language)}</code></pre>`);
  return i + 1;  // past the closing fence (a reply still streaming may not have written it yet)
}

function quote(lines, i, html) {
  const inner = [];
  while (i < lines.length && QUOTE.test(lines[i])) inner.push(lines[i++].replace(QUOTE, ""));
  html.push(`<blockquote>${blocks(inner, false)}</blockquote>`);
  return i;
}

function nextFilled(lines, i) {
  while (i < lines.length && !lines[i].trim()) i++;
  return i;
}

// One list: its items are the markers at its own indentation; lines indented past it belong to the
// item above them (rendered as blocks of their own, so lists and code nest), blank lines make it loose.
function list(lines, i, html) {
  const first = lines[i].match(ITEM);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const kind = first[2].slice(-1);  // "-", "*" or "+"; "." or ")": another one starts another list
  const sibling = (line) => {
    const match = line.match(ITEM);
    return match && match[1].length <= indent + 1 && match[2].slice(-1) === kind && !RULE.test(line);
  };
  const items = [];
  let loose = false;
  while (i < lines.length && sibling(lines[i])) {
    const match = lines[i].match(ITEM);
    const width = match[1].length + match[2].length + 1;  // where the item's text starts
    const body = [match[3] ?? ""];
    for (i++; i < lines.length; i++) {
      const line = lines[i];
      if (!line.trim()) {
        const next = nextFilled(lines, i);
        if (next === lines.length || leading(lines[next]) <= indent + 1) break;
        body.push("");
      } else if (leading(line) > indent + 1) body.push(line.slice(Math.min(width, leading(line))));
      else if (startsBlock(lines, i)) break;
      else body.push(line.trim());  // a paragraph's lazy continuation line
    }
    items.push(body);
    const next = nextFilled(lines, i);
    if (next > i && next < lines.length && sibling(lines[next])) { loose = true; i = next; }
  }
  const start = ordered ? parseInt(first[2], 10) : 1;
  const open = ordered ? (start === 1 ? "<ol>" : `<ol start="${start}">`) : "<ul>";
  const tight = !loose && !items.some((body) => body.includes(""));
  const content = items.map((body) => `<li>${blocks(body, tight)}</li>`).join("");
  html.push(open + content + (ordered ? "</ol>" : "</ul>"));
  return i;
}

function cells(line) {
  let text = line.trim();
  if (text.startsWith("|")) text = text.slice(1);
  if (text.endsWith("|") && !text.endsWith("\\|")) text = text.slice(0, -1);
  return text.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function table(lines, i, html) {
  const head = cells(lines[i]);
  const align = cells(lines[i + 1]).map((rule) => {
    if (rule.startsWith(":") && rule.endsWith(":")) return "center";
    return rule.endsWith(":") ? "right" : rule.startsWith(":") ? "left" : "";
  });
  const row = (tag, values) => "<tr>" + head.map((_, k) => {
    const style = align[k] ? ` style="text-align: ${align[k]}"` : "";
    return `<${tag}${style}>${inline(values[k] ?? "")}</${tag}>`;
  }).join("") + "</tr>";
  const body = [];
  for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) body.push(row("td", cells(lines[i])));
  html.push(`<table><thead>${row("th", head)}</thead><tbody>${body.join("")}</tbody></table>`);
  return i;
}

function paragraph(lines, i, html, tight) {
  const text = [inline(lines[i++].trim())];
  while (i < lines.length && lines[i].trim() && !startsBlock(lines, i)) text.push(inline(lines[i++].trim()));
  html.push(tight ? text.join("<br>") : `<p>${text.join("<br>")}</p>`);
  return i;
}

// Inline markup. Code spans and links are set aside first (as \u0000N\u0000) so that emphasis never
// reaches into them; the rest is escaped, then marked up, then the set-aside pieces are put back.
export function inline(text) {
  const kept = [];
  const restore = (html) => html.replace(/\u0000(\d+)\u0000/g, (_, n) => kept[n]);
  const keep = (html) => `\u0000${kept.push(restore(html)) - 1}\u0000`;
  const rest = text.replace(/\u0000/g, "")
    .replace(/`([^`]+)`/g, (_, code) => keep(`<code>${escapeHtml(code)}</code>`))
    .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, (_, label, url) =>
      keep(`<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">${emphasis(escapeHtml(label))}</a>`));
  return restore(emphasis(escapeHtml(rest)));
}

function emphasis(html) {
  return html
    .replace(/\*\*(?=\S)(.*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|\W)__(?=\S)(.*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/~~(?=\S)(.*?\S)~~/g, "<s>$1</s>")
    .replace(/(^|[^*\w])\*([^\s*](?:[^*]*?[^\s*])?)\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^_\w])_([^\s_](?:[^_]*?[^\s_])?)_(?![_\w])/g, "$1<em>$2</em>");
}
