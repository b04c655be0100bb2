// A real browser for tests/test_page.py: Debian's chromium driven by playwright-core.
//
// Reads one JSON command per line on stdin and answers one JSON line on stdout:
//   {"id": 1, "op": "goto", "url": "http://..."}               -> {"id": 1, "ok": true}
//   {"id": 2, "op": "wait", "js": "<expression>", "timeout_ms": 30000}
//                                     waits until the expression is truthy, answers its value
//   {"id": 3, "op": "eval", "js": "<expression>"}              -> {"id": 3, "ok": true, "value": ...}
//   {"id": 4, "op": "click" | "check", "selector": "css"}
//   {"id": 5, "op": "fill" | "select", "selector": "css", "value": "..."}
//   {"id": 6, "op": "screenshot", "path": "/tmp/x.png"}
//   {"id": 7, "op": "emulate", "width": 390, "height": 844, "color_scheme": "dark"}
//   {"id": 8, "op": "press", "selector": "css", "key": "Enter"}   focuses the element, presses the key
//   {"id": 9, "op": "keys", "keys": ["Tab", "Enter"]}           presses keys where the focus is
//   {"id": 10, "op": "download", "selector": "css", "path": "/tmp/x"}
//                                     clicks, saves the download there, answers its suggested name
//   {"id": 11, "op": "axe"}          runs axe-core (WCAG 2.0-2.2 A and AA) on the page as it is,
//                                     answers the violations: [{id, impact, help, nodes: [html]}]
//   {"id": 12, "op": "frames"}       answers [{url, js}] for every frame of the page, with js
//                                     (an expression, "js" in the command) evaluated in it
//   {"id": 13, "op": "close"}
// A failure answers {"id", "ok": false, "error": "..."}. Console errors of the page are
// written to stderr. Usage: node driver.mjs [/usr/bin/chromium] [width] [height]
import { createInterface } from "node:readline";
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { chromium } from "playwright-core";

const axeSource = readFileSync(createRequire(import.meta.url).resolve("axe-core/axe.min.js"), "utf8");

const executablePath = process.argv[2] || "/usr/bin/chromium";
const width = Number(process.argv[3] || 1100), height = Number(process.argv[4] || 800);
const browser = await chromium.launch({ executablePath, args: ["--no-sandbox"] });
const context = await browser.newContext({ acceptDownloads: true, viewport: { width, height }, colorScheme: process.env.COLOR_SCHEME || "light" });
const page = await context.newPage();
page.on("console", (m) => { if (m.type() === "error") process.stderr.write(`console: ${m.text()}\n`); });
page.on("pageerror", (e) => process.stderr.write(`pageerror: ${e.message}\n`));

const ops = {
  goto: async (c) => { await page.goto(c.url); },
  // Polls with page.evaluate (DevTools' Runtime.evaluate): waitForFunction would compile the
  // expression with eval inside the page, which the page's Content Security Policy forbids.
  wait: async (c) => {
    const end = Date.now() + (c.timeout_ms || 30000);
    let last;
    for (;;) {
      try { last = await page.evaluate(c.js); } catch (e) { last = `error: ${e.message}`; }
      if (last && !String(last).startsWith("error: ")) return last;
      if (Date.now() > end) throw new Error(`timed out waiting for ${c.js} (last value: ${JSON.stringify(last)})`);
      await new Promise((r) => setTimeout(r, 50));
    }
  },
  eval: async (c) => page.evaluate(c.js),
  click: async (c) => { await page.click(c.selector, { timeout: c.timeout_ms || 10000 }); },
  check: async (c) => { await page.check(c.selector, { timeout: c.timeout_ms || 10000 }); },
  fill: async (c) => { await page.fill(c.selector, c.value, { timeout: c.timeout_ms || 10000 }); },
  select: async (c) => { await page.selectOption(c.selector, c.value, { timeout: c.timeout_ms || 10000 }); },
  emulate: async (c) => {
    await page.setViewportSize({ width: c.width, height: c.height });
    await page.emulateMedia({ colorScheme: c.color_scheme });
  },
  screenshot: async (c) => { await page.screenshot({ path: c.path, fullPage: !!c.full_page }); },
  press: async (c) => { await page.press(c.selector, c.key, { timeout: c.timeout_ms || 10000 }); },
  keys: async (c) => { for (const k of c.keys) await page.keyboard.press(k); },
  download: async (c) => {
    const [dl] = await Promise.all([page.waitForEvent("download", { timeout: c.timeout_ms || 10000 }), page.click(c.selector)]);
    await dl.saveAs(c.path);
    return dl.suggestedFilename();
  },
  // axe-core is evaluated through DevTools, like every page.evaluate: the page's Content
  // Security Policy (script-src 'self') stays as it is for the page's own code
  axe: async () => {
    if (!(await page.evaluate("typeof axe !== 'undefined'"))) await page.evaluate(axeSource);
    const result = await page.evaluate(`axe.run(document, { runOnly: { type: "tag",
      values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "wcag22aa", "best-practice"] } })
      .then((r) => r.violations.map((v) => ({ id: v.id, impact: v.impact, help: v.help,
        nodes: v.nodes.map((n) => n.html.slice(0, 200) + " " + (n.failureSummary || "").slice(0, 300)) })))`);
    return result;
  },
  frames: async (c) => Promise.all(page.frames().map(async (f) => {
    let value;
    try { value = await f.evaluate(c.js); } catch (e) { value = `error: ${e.message}`; }
    return { url: f.url(), js: value };
  })),
  close: async () => { await browser.close(); },
};

process.stdout.write(JSON.stringify({ id: 0, ok: true, value: browser.version() }) + "\n");
const rl = createInterface({ input: process.stdin });
for await (const line of rl) {
  if (!line.trim()) continue;
  const c = JSON.parse(line);
  try {
    const value = await ops[c.op](c);
    process.stdout.write(JSON.stringify({ id: c.id, ok: true, value: value ?? null }) + "\n");
  } catch (e) {
    process.stdout.write(JSON.stringify({ id: c.id, ok: false, error: String(e && e.message || e) }) + "\n");
  }
  if (c.op === "close") break;
}
process.exit(0);
