// Headless Chromium (Debian's, driven by puppeteer-core) trains the fixture
// bundles with onnxruntime-web's WASM build, from a page served on
// 127.0.0.1 that imports the package's browser entry with no bundler; the
// results agree with Python's within float rounding, and the bundles the
// page gives back (bundleFiles) load in Python, train on and export.

import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, test } from 'node:test';

import { JS_ROOT, closeness, fixtures, runPython } from '../helpers.mjs';
import { launch, openPage, serve } from './harness.mjs';

const { dir, cases } = fixtures();
let server;
let chromium;
let page;
const log = [];
const back = mkdtempSync(path.join(tmpdir(), 'onnxtrain-from-chromium-'));

before(async () => {
  server = await serve({
    '/onnxtrain/': path.join(JS_ROOT, 'src'),
    '/ort/': path.join(JS_ROOT, 'node_modules', 'onnxruntime-web', 'dist'),
    '/fixtures/': dir,
    '/': path.join(JS_ROOT, 'test', 'browser'),
  });
  chromium = await launch();
  page = await openPage(chromium.browser, `${server.url}/page.html`, log);
  await page.waitForFunction('window.ready === true', { timeout: 30000 });
});

after(async () => {
  await chromium?.close();
  await server?.close();
  rmSync(back, { recursive: true, force: true });
});

/** Python's state after the steps, variable by variable, as numbers. */
function expectedState(folder) {
  const manifest = JSON.parse(readFileSync(path.join(folder, 'manifest.json'), 'utf8'));
  const raw = readFileSync(path.join(folder, 'state.bin'));
  return { manifest, raw };
}

function compareState(bytes, folder, what) {
  const { manifest, raw } = expectedState(folder);
  const got = Buffer.from(bytes);
  assert.equal(got.length, raw.length, `${what}: state.bin size`);
  const arrays = { float32: Float32Array, float64: Float64Array, int64: BigInt64Array };
  for (const v of manifest.state) {
    const Array = arrays[v.dtype];
    const view = (b) => new Array(b.buffer.slice(b.byteOffset + v.offset, b.byteOffset + v.offset + v.length));
    const worst = closeness(view(got), view(raw));
    assert.ok(worst <= 1, `${what}: state variable '${v.name}' is off by ${worst.toExponential(2)} tolerances`);
  }
}

function readArray(spec) {
  const arrays = { float32: Float32Array, int64: BigInt64Array };
  const b = readFileSync(path.join(dir, spec.file));
  return new arrays[spec.dtype](b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength));
}

for (const c of Object.values(cases).filter((k) => k.steps)) {
  test(`${c.name} trains in Chromium (onnxruntime-web WASM) as in Python`, async () => {
    const result = await page.evaluate((k) => window.replay(k), c);
    result.steps.forEach((out, i) => {
      for (const [name, spec] of Object.entries(c.steps[i].outputs)) {
        assert.deepEqual(out[name].dims, spec.shape, `step ${i} '${name}' shape`);
        const worst = closeness(out[name].data, readArray(spec));
        assert.ok(worst <= 1, `${c.name} step ${i}: '${name}' is off by ${worst.toExponential(2)} tolerances`);
      }
    });
    for (const [name, spec] of Object.entries(c.run.outputs)) {
      assert.ok(closeness(result.run[name].data, readArray(spec)) <= 1, `${c.name} run: '${name}'`);
    }
    compareState(result.state, path.join(dir, c.after), c.name);
    assert.match(result.saveError, /save\(folder\) writes files and needs Node/);
    const folder = path.join(back, c.name);
    mkdirSync(folder);
    for (const [name, text] of Object.entries(result.files)) writeFileSync(path.join(folder, name), Buffer.from(text, 'base64'));
    assert.deepEqual(log.filter((l) => l.startsWith('pageerror')), []);
  });
}

test('fit continues a Python fit checkpoint in Chromium', async () => {
  const c = cases.fit;
  const result = await page.evaluate((k) => window.fitCase(k), c);
  assert.deepEqual(result.position, c.fit.position);
  result.loss.forEach((loss, i) => assert.ok(Math.abs(loss - c.fit.loss[i]) <= 1e-4 * Math.abs(c.fit.loss[i]), `epoch ${i}: ${loss} vs ${c.fit.loss[i]}`));
  compareState(result.state, path.join(dir, c.after), 'fit');
});

test('the bundles trained in Chromium come back to Python: load, the state, one more step, export', () => {
  const names = Object.values(cases).filter((k) => k.steps).map((k) => k.name);
  const out = runPython(['-c', `
import json, sys, numpy as np, onnxruntime as ort
from pathlib import Path
from onnxtrain import bundle
fixtures, back = Path(sys.argv[1]), Path(sys.argv[2])
cases = json.loads((fixtures / "cases.json").read_text())
def array(spec):
    return np.fromfile(fixtures / spec["file"], dtype=spec["dtype"]).reshape(spec["shape"])
for name in sys.argv[3:]:
    c = cases[name]
    sess, python = bundle.load(back / name), bundle.load(fixtures / c["after"])
    for var, value in python.state.items():
        np.testing.assert_allclose(sess.state[var], value, rtol=1e-4, atol=1e-5, err_msg=f"{name} {var}")
    feeds = {k: array(s) for k, s in c["steps"][0]["feeds"].items()}
    algorithm = c["steps"][0]["algorithm"]
    got, want = sess.train_step(feeds, algorithm=algorithm), python.train_step(feeds, algorithm=algorithm)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-4, err_msg=name)
    run = {k: array(s) for k, s in c["run"]["feeds"].items()}
    sess.export(back / f"{name}.onnx")
    plain = ort.InferenceSession(str(back / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    for output, value in zip([o.name for o in plain.get_outputs()], plain.run(None, run)):
        np.testing.assert_allclose(value, sess.run(run)[output], rtol=1e-5, atol=1e-6, err_msg=name)
    print("back", name)
`, dir, back, ...names]);
  assert.deepEqual(out.trim().split('\n'), names.map((n) => `back ${n}`));
});
