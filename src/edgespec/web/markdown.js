// A small Markdown renderer for model answers: fenced code blocks, inline code, headings,
// lists, bold/italic, links, paragraphs. Everything is HTML-escaped first, so model output
// can never inject markup; links are kept only for http(s) URLs.
"use strict";
const Markdown = (() => {
  const esc = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;");

  function inline(text) {
    const parts = text.split(/(`[^`\n]+`)/g);
    return parts.map((p) => {
      if (p.length > 1 && p.startsWith("`") && p.endsWith("`")) {
        return "<code>" + esc(p.slice(1, -1)) + "</code>";
      }
      return esc(p)
        .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
        .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g,
                 '<a href="$2" rel="noopener noreferrer" target="_blank">$1</a>');
    }).join("");
  }

  function render(src) {
    const out = [];
    const lines = src.replace(/\r\n/g, "\n").split("\n");
    let para = [];
    let list = null; // "ul" | "ol"
    const flushPara = () => {
      if (para.length) out.push("<p>" + inline(para.join("\n")).replace(/\n/g, "<br>") + "</p>");
      para = [];
    };
    const closeList = () => { if (list) { out.push(`</${list}>`); list = null; } };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
      if (fence) {
        flushPara(); closeList();
        const body = [];
        i++;
        while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
        // An unclosed fence (still streaming) renders as code so far.
        const lang = fence[1] ? ` class="language-${esc(fence[1])}"` : "";
        out.push(`<pre><code${lang}>` + esc(body.join("\n")) + "</code></pre>");
        continue;
      }
      const h = line.match(/^(#{1,6})\s+(.*)$/);
      const ul = line.match(/^\s*[-*+]\s+(.*)$/);
      const ol = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (h) {
        flushPara(); closeList();
        out.push(`<h${h[1].length + 2 > 6 ? 6 : h[1].length + 2}>` + inline(h[2]) + "</h" +
                 (h[1].length + 2 > 6 ? 6 : h[1].length + 2) + ">");
      } else if (ul || ol) {
        flushPara();
        const kind = ul ? "ul" : "ol";
        const nested = /^\s{2,}/.test(line) && list && list !== kind;
        if (nested) {
          // An indented list under an item of the other kind: a sub-list of that item.
          if (out[out.length - 1] === "</li>") out.pop();
          const sub = [];
          while (i < lines.length && /^\s{2,}([-*+]|\d+[.)])\s+/.test(lines[i])) {
            sub.push(lines[i].replace(/^\s{2,}([-*+]|\d+[.)])\s+/, ""));
            i++;
          }
          i--;
          out.push(`<${kind}>` + sub.map((t) => "<li>" + inline(t) + "</li>").join("") +
                   `</${kind}></li>`);
          continue;
        }
        if (list !== kind) { closeList(); out.push(`<${kind}>`); list = kind; }
        out.push("<li>" + inline((ul || ol)[1]), "</li>");
      } else if (!line.trim()) {
        flushPara();
        // A blank line between items keeps the list going (a "loose" list).
        let j = i + 1;
        while (j < lines.length && !lines[j].trim()) j++;
        if (!(list && j < lines.length && /^\s*([-*+]|\d+[.)])\s+/.test(lines[j]))) closeList();
      } else {
        closeList();
        para.push(line);
      }
    }
    flushPara(); closeList();
    return out.join("");
  }
  return { render, escape: esc };
})();
