// A static file server on 127.0.0.1 and Debian's Chromium driven by
// puppeteer-core: shared by the browser test, the browser benchmark and the
// web example's screenshot.  Nothing is downloaded: the browser is the
// system's (/usr/bin/chromium, or $CHROMIUM).

import { createReadStream, existsSync, mkdtempSync, rmSync, statSync } from 'node:fs';
import { createServer } from 'node:http';
import { tmpdir } from 'node:os';
import path from 'node:path';

const TYPES = {
  '.html': 'text/html; charset=utf-8', '.js': 'text/javascript', '.mjs': 'text/javascript',
  '.json': 'application/json', '.wasm': 'application/wasm', '.css': 'text/css', '.png': 'image/png',
};

/**
 * Serve folders: `routes` maps a URL prefix ('/ort/') to a folder.  With
 * `isolated`, pages are cross-origin isolated (COOP/COEP), which WASM
 * threads need.  Returns { url, close() }.
 */
export async function serve(routes, { isolated = false } = {}) {
  const table = Object.entries(routes).sort((a, b) => b[0].length - a[0].length);
  const server = createServer((req, res) => {
    const url = new URL(req.url, 'http://127.0.0.1');
    const pathname = decodeURIComponent(url.pathname);
    const route = table.find(([prefix]) => pathname.startsWith(prefix));
    let file = route && path.join(route[1], pathname.slice(route[0].length));
    if (file && existsSync(file) && statSync(file).isDirectory()) file = path.join(file, 'index.html');
    if (req.method !== 'GET' || !route || !file.startsWith(path.resolve(route[1])) || !existsSync(file)) {
      res.writeHead(404).end('not found');
      return;
    }
    const headers = { 'content-type': TYPES[path.extname(file)] ?? 'application/octet-stream', 'cache-control': 'no-store' };
    if (isolated) Object.assign(headers, { 'cross-origin-opener-policy': 'same-origin', 'cross-origin-embedder-policy': 'require-corp' });
    res.writeHead(200, headers);
    createReadStream(file).pipe(res);
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    close: () => new Promise((resolve) => server.close(resolve)),
  };
}

/** The system's Chromium: $CHROMIUM, else /usr/bin/chromium. */
export function chromiumPath() {
  return process.env.CHROMIUM || '/usr/bin/chromium';
}

/** Launch headless Chromium with a fresh profile; returns { browser, close() }. */
export async function launch() {
  const executablePath = chromiumPath();
  if (!existsSync(executablePath)) {
    throw new Error(`no Chromium at ${executablePath}: install Debian's (apt-get install chromium) or set $CHROMIUM`);
  }
  const { default: puppeteer } = await import('puppeteer-core');
  const profile = mkdtempSync(path.join(tmpdir(), 'onnxtrain-chromium-'));
  const browser = await puppeteer.launch({
    executablePath,
    headless: true,
    args: ['--headless=new', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
      '--disable-component-update', '--disable-sync', '--no-first-run', `--user-data-dir=${profile}`],
  });
  return {
    browser,
    async close() {
      await browser.close();
      rmSync(profile, { recursive: true, force: true });
    },
  };
}

/** A new page that reports its console errors and uncaught exceptions into `log`. */
export async function openPage(browser, url, log = []) {
  const page = await browser.newPage();
  page.on('console', (msg) => log.push(`console.${msg.type()}: ${msg.text()}`));
  page.on('pageerror', (err) => log.push(`pageerror: ${err.message}`));
  await page.goto(url, { waitUntil: 'load' });
  return page;
}
