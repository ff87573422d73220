// examples/web as the README runs it: prepare.py writes the page's files,
// python's http.server serves them on 127.0.0.1, Chromium trains the digits
// classifier; the downloaded inference.onnx + state.bin give the same test
// accuracy in Python's plain onnxruntime.  $ONNXTRAIN_SCREENSHOT=FILE.png
// keeps a screenshot of the page after training.

import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, test } from 'node:test';

import { REPO, python, runPython } from '../helpers.mjs';
import { launch, openPage } from './harness.mjs';

const work = mkdtempSync(path.join(tmpdir(), 'onnxtrain-web-example-'));
const cleanups = [() => rmSync(work, { recursive: true, force: true })];
after(async () => {
  for (const f of cleanups.reverse()) await f();
});

/** `python -m http.server 0 --bind 127.0.0.1 --directory DIR`; resolves to its URL. */
function httpServer(dir) {
  const child = spawn(python(), ['-u', '-m', 'http.server', '0', '--bind', '127.0.0.1', '--directory', dir], { stdio: ['ignore', 'pipe', 'pipe'] });
  cleanups.push(() => child.kill());
  return new Promise((resolve, reject) => {
    let text = '';
    child.stdout.on('data', (chunk) => {
      text += chunk;
      const m = /Serving HTTP on 127\.0\.0\.1 port (\d+)/.exec(text);
      if (m) resolve(`http://127.0.0.1:${m[1]}`);
    });
    child.on('exit', (code) => reject(new Error(`http.server exited ${code}: ${text}`)));
  });
}

test('the web example trains the digits classifier in Chromium and its downloads run in onnxruntime', async () => {
  const site = path.join(work, 'site');
  runPython([path.join(REPO, 'examples', 'web', 'prepare.py'), '--out', site]);
  for (const f of ['index.html', 'app.js', 'digits.bin', 'digits.json', 'bundle/manifest.json', 'vendor/ort/ort.wasm.min.mjs', 'vendor/onnxtrain/index.js']) {
    assert.ok(existsSync(path.join(site, f)), f);
  }
  const url = await httpServer(site);
  const chromium = await launch();
  cleanups.push(() => chromium.close());
  const log = [];
  const page = await openPage(chromium.browser, `${url}/index.html`, log);
  await page.setViewport({ width: 960, height: 760 });
  await page.waitForFunction("document.body.dataset.state === 'ready'", { timeout: 60000 });
  const downloads = path.join(work, 'downloads');
  const cdp = await page.createCDPSession();
  await cdp.send('Browser.setDownloadBehavior', { behavior: 'allow', downloadPath: downloads });

  await page.$eval('#epochs', (e) => { e.value = '4'; });
  await page.click('#train');
  await page.waitForFunction("document.body.dataset.state === 'done'", { timeout: 180000 });
  const demo = await page.evaluate(() => window.onnxtrainDemo);
  assert.equal(demo.position.epoch, 4);
  assert.equal(demo.losses.length, 4);
  assert.ok(demo.losses[3] < demo.losses[0] / 2, `the loss falls: ${demo.losses}`);
  assert.ok(demo.accuracy > 0.9, `test accuracy ${demo.accuracy}`);
  assert.match(await page.$eval('#accuracy', (e) => e.textContent), /^\d+\.\d%$/);
  if (process.env.ONNXTRAIN_SCREENSHOT) await page.screenshot({ path: process.env.ONNXTRAIN_SCREENSHOT, fullPage: true });

  await page.click('#dl-model');
  await page.click('#dl-state');
  const deadline = Date.now() + 30000;
  while (!(['inference.onnx', 'state.bin'].every((f) => readdirSync(downloads).includes(f))) && Date.now() < deadline) {
    await new Promise((r) => setTimeout(r, 200));
  }
  const check = runPython(['-c', `
import json, numpy as np, onnxruntime as ort
X = np.fromfile("${site}/digits.bin", np.uint8)
meta = json.load(open("${site}/digits.json"))
n, m, f = meta["train"], meta["test"], meta["features"]
at = n * f + n
Xt = X[at:at + m * f].reshape(m, f).astype(np.float32) / meta["scale"]
yt = X[at + m * f:at + m * f + m]
s = ort.InferenceSession("${downloads}/inference.onnx", providers=["CPUExecutionProvider"])
print(json.dumps(float(np.mean(s.run(None, {s.get_inputs()[0].name: Xt})[0].argmax(1) == yt))))
`]);
  assert.ok(Math.abs(JSON.parse(check) - demo.accuracy) <= 0.006, `downloaded model: ${check} vs the page's ${demo.accuracy}`);
  assert.deepEqual(log.filter((l) => l.startsWith('pageerror') || l.startsWith('console.error')), []);
});
