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
//   {"id": 7, "op": "close"}
// A failure answers {"id", "ok": false, "error": "..."}. Console errors of the page are
// written to stderr. Usage: node driver.mjs [/usr/bin/chromium] [width] [height]
import { createInterface } from "node:readline";
import { chromium } from "playwright-core";

const executablePath = process.argv[2] || "/usr/bin/chromium";
const width = Number(process.argv[3] || 1100), height = Number(process.argv[4] || 800);
const browser = await chromium.launch({ executablePath, args: ["--no-sandbox"] });
const context = await browser.newContext({ viewport: { width, height }, colorScheme: process.env.COLOR_SCHEME || "light" });
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
