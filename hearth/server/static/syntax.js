// HTML escaping, and a small highlighter for fenced code: one regular expression per language finds
// comments, strings, numbers and keywords; the text between them and in them is escaped, and each
// token is wrapped in <span class="tok-KIND">. No library: enough for the languages models write most.
"use strict";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const SLASH_COMMENTS = String.raw`\/\/[^\n]*|\/\*[\s\S]*?\*\/`;
const HASH_COMMENTS = String.raw`#[^\n]*`;
const QUOTED = String.raw`"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'`;
const NUMBER = String.raw`\b(?:0[xX][\da-fA-F_]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b`;

const LANGUAGES = {
  python: {
    comment: HASH_COMMENTS,
    string: String.raw`[rbfuRBFU]{0,2}(?:"""[\s\S]*?"""|'''[\s\S]*?'''|${QUOTED})`,
    keywords: "and as assert async await break class continue def del elif else except False finally for from global if "
      + "import in is lambda None nonlocal not or pass raise return True try while with yield match case",
  },
  javascript: {
    comment: SLASH_COMMENTS,
    string: String.raw`${QUOTED}|\`(?:\\.|[^\`\\])*\``,
    keywords: "async await break case catch class const continue default delete do else export extends false finally for "
      + "from function if import in instanceof interface let new null return static super switch this throw true try type "
      + "typeof undefined var void while yield",
  },
  json: { string: QUOTED, keywords: "true false null" },
  bash: {
    comment: HASH_COMMENTS,
    string: QUOTED,
    keywords: "if then else elif fi for while until do done case esac in function return export local echo cd exit "
      + "source sudo set unset",
  },
  c: {
    comment: SLASH_COMMENTS,
    string: QUOTED,
    keywords: "auto bool break case char class const constexpr continue default delete do double else enum extern false "
      + "float for if include define inline int long namespace new nullptr private protected public return short signed "
      + "sizeof static struct switch template this throw true try typedef typename union unsigned using virtual void "
      + "volatile while std",
  },
  java: {
    comment: SLASH_COMMENTS,
    string: QUOTED,
    keywords: "abstract boolean break byte case catch char class continue default do double else enum extends final "
      + "finally float for if implements import instanceof int interface long new null package private protected public "
      + "return short static super switch this throw throws true false try void while var",
  },
  go: {
    comment: SLASH_COMMENTS,
    string: String.raw`${QUOTED}|\`[^\`]*\``,
    keywords: "break case chan const continue default defer else fallthrough for func go goto if import interface map "
      + "package range return select struct switch type var nil true false string int error bool byte",
  },
  rust: {
    comment: SLASH_COMMENTS,
    string: String.raw`"(?:\\.|[^"\\])*"`,
    keywords: "as async await break const continue crate else enum extern false fn for if impl in let loop match mod "
      + "move mut pub ref return self Self static struct super trait true type unsafe use where while Some None Ok Err",
  },
  sql: {
    comment: String.raw`--[^\n]*`,
    string: QUOTED,
    keywords: "select from where and or not insert into values update set delete create table drop alter index join "
      + "left right inner outer on group by order having limit as distinct null is in like primary key",
    flags: "i",
  },
};
const ALIASES = {
  py: "python", python3: "python", js: "javascript", jsx: "javascript", ts: "javascript", tsx: "javascript",
  typescript: "javascript", node: "javascript", sh: "bash", shell: "bash", zsh: "bash", console: "bash",
  "c++": "c", cpp: "c", cc: "c", h: "c", hpp: "c", cs: "java", csharp: "java", kotlin: "java", golang: "go", rs: "rust",
};
const KINDS = ["comment", "string", "number", "keyword"];
const grammars = new Map();  // language -> its one regular expression, built when first needed

function grammar(language) {
  const name = ALIASES[language.toLowerCase()] ?? language.toLowerCase();
  const spec = Object.hasOwn(LANGUAGES, name) ? LANGUAGES[name] : null;
  if (!spec) return null;
  if (!grammars.has(name)) {
    const keywords = String.raw`\b(?:${spec.keywords.split(" ").join("|")})\b`;
    // an alternative that can never match stands in for a language without comments
    const parts = [spec.comment ?? "(?!)", spec.string, NUMBER, keywords].map((part) => `(${part})`);
    grammars.set(name, new RegExp(parts.join("|"), "g" + (spec.flags ?? "")));
  }
  return grammars.get(name);
}

export function highlight(code, language) {
  const pattern = language ? grammar(language) : null;
  if (!pattern) return escapeHtml(code);
  let html = "";
  let last = 0;
  for (const match of code.matchAll(pattern)) {
    const kind = KINDS[match.slice(1).findIndex((group) => group !== undefined)];
    html += escapeHtml(code.slice(last, match.index)) + `<span class="tok-${kind}">${escapeHtml(match[0])}</span>`;
    last = match.index + match[0].length;
  }
  return html + escapeHtml(code.slice(last));
}
