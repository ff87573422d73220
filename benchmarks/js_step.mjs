// The JavaScript benchmark children (js_bundle.py drives them), in JSON
// lines like worker.py's:
//
//   node benchmarks/js_step.mjs node WORKDIR THREADS
//       trains WORKDIR's bundle with the npm package on onnxruntime-node;
//   node benchmarks/js_step.mjs browser ROOT THREADS KEY[,KEY...]
//       headless Chromium (js/test/browser/harness.mjs) trains ROOT/KEY's
//       bundles with onnxruntime-web's WASM build (js_page.html).
//
//   start                 -> {"ready": true, "load_ms", "first_step_ms", "losses"} (browser: by key)
//   {"run": n[, "key"]}   -> {"times_ms": [...]}
//   {"exit": true}        -> {"maxrss_kb"}
//
// A WORKDIR holds bundle/ and the batch as batch.json + NAME.bin files.

import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import readline from 'node:readline';

const fromJs = createRequire(new URL('../js/package.json', import.meta.url));
const ort = fromJs('onnxruntime-node');
const { TrainingSession } = await import(new URL('../js/src/node.js', import.meta.url));

const [mode, workdir, threads, keys] = process.argv.slice(2);
const ARRAYS = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array, float64: Float64Array };
const send = (obj) => process.stdout.write(`${JSON.stringify(obj)}\n`);

if (mode === 'browser') await browser();
else await node();
process.exit(0); // stdin stays open: leave without waiting for it

async function node() {
  const batch = JSON.parse(readFileSync(path.join(workdir, 'batch.json'), 'utf8'));
  const feeds = {};
  for (const [name, spec] of Object.entries(batch)) {
    const bytes = readFileSync(path.join(workdir, `${name}.bin`));
    feeds[name] = new ort.Tensor(spec.dtype, new ARRAYS[spec.dtype](bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength)), spec.shape);
  }
  const sessionOptions = {
    intraOpNumThreads: Number(threads),
    interOpNumThreads: 1,
    executionMode: 'sequential',
    // Idle intra-op threads block, as every framework of run.py on this shared machine.
    extra: { session: { intra_op: { allow_spinning: process.env.BENCH_ORT_SPIN ?? '0' } } },
  };
  let t = performance.now();
  const sess = await TrainingSession.load(ort, path.join(workdir, 'bundle'), { sessionOptions });
  const loadMs = performance.now() - t;
  const losses = [];
  t = performance.now();
  let out = await sess.trainStep(feeds);
  const firstMs = performance.now() - t;
  losses.push(Number(out.loss.data[0]));
  for (let i = 0; i < 4; i++) {
    out = await sess.trainStep(feeds);
    losses.push(Number(out.loss.data[0]));
  }
  send({ ready: true, load_ms: loadMs, first_step_ms: firstMs, losses });

  for await (const line of readline.createInterface({ input: process.stdin })) {
    const msg = JSON.parse(line);
    if (msg.exit) break;
    const times = [];
    for (let i = 0; i < msg.run; i++) {
      const start = performance.now();
      await sess.trainStep(feeds);
      times.push(performance.now() - start);
    }
    send({ times_ms: times });
  }
  send({ maxrss_kb: process.resourceUsage().maxRSS });
}

async function browser() {
  const { launch, openPage, serve } = await import(new URL('../js/test/browser/harness.mjs', import.meta.url));
  const js = new URL('../js/', import.meta.url).pathname;
  const server = await serve({
    '/onnxtrain/': path.join(js, 'src'),
    '/ort/': path.join(js, 'node_modules', 'onnxruntime-web', 'dist'),
    '/work/': workdir,
    '/': new URL('.', import.meta.url).pathname,
  }, { isolated: Number(threads) > 1 });
  const chromium = await launch();
  const log = [];
  const page = await openPage(chromium.browser, `${server.url}/js_page.html?threads=${threads}`, log);
  await page.waitForFunction('window.ready === true', { timeout: 60000 });
  let setup;
  try {
    setup = await page.evaluate((k) => window.setup(k), keys.split(','));
  } catch (err) {
    throw new Error(`${err.message}\n${log.join('\n')}`);
  }
  send({ ready: true, ...setup });
  for await (const line of readline.createInterface({ input: process.stdin })) {
    const msg = JSON.parse(line);
    if (msg.exit) break;
    send({ times_ms: await page.evaluate((k, n) => window.steps(k, n), msg.key, msg.run) });
  }
  await chromium.close();
  await server.close();
  send({ maxrss_kb: process.resourceUsage().maxRSS });
}
