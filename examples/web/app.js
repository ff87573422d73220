// The page's logic: load the bundle and the digits, train with fit(), draw
// the loss curve and the test accuracy, offer the trained files.

import * as ort from 'onnxruntime-web';
import { TrainingSession } from 'onnxtrain';

// (an absolute URL: onnxruntime-web resolves a relative one against its own module's)
ort.env.wasm.wasmPaths = new URL('./vendor/ort/', location.href).href;
// WASM threads need a cross-origin isolated page (COOP/COEP headers), which
// python's http.server does not send: one thread then.
ort.env.wasm.numThreads = globalThis.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;

const $ = (id) => document.getElementById(id);
const ui = {
  epochs: $('epochs'), batch: $('batch'), lr: $('lr'), train: $('train'), stop: $('stop'), reset: $('reset'),
  status: $('status'), chart: $('chart'), digits: $('digits'), accuracy: $('accuracy'), epoch: $('epoch'),
  step: $('step'), loss: $('loss'), speed: $('speed'), dlModel: $('dl-model'), dlState: $('dl-state'),
  dlConstants: $('dl-constants'),
};
const history = { steps: [], epochs: [], accuracy: [] };
let sess;
let initialFiles;
let data;
let controller = null;

function status(text, error = false) {
  ui.status.textContent = text;
  ui.status.className = error ? 'error' : '';
}

/** digits.bin (uint8 counts, see prepare.py) -> float32 pixels in [0, 1] and int64 labels. */
async function loadDigits() {
  const meta = await (await fetch('digits.json')).json();
  const bytes = new Uint8Array(await (await fetch('digits.bin')).arrayBuffer());
  const f = meta.features;
  let at = 0;
  const take = (n) => bytes.subarray(at, (at += n));
  const pixels = (n) => Float32Array.from(take(n * f), (v) => v / meta.scale);
  const labels = (n) => BigInt64Array.from(take(n), (v) => BigInt(v));
  const trainX = pixels(meta.train);
  const trainY = labels(meta.train);
  const testX = pixels(meta.test);
  const testY = labels(meta.test);
  return { features: f, train: { X: trainX, y: trainY, n: meta.train }, test: { X: testX, y: testY, n: meta.test } };
}

function names() {
  const m = sess.manifest;
  const input = m.training?.inputs?.[0] ?? m.inference.feeds[0].name;
  const rank = m.inference.feeds.find((f) => f.name === input).shape.length;
  return { input, target: m.training?.target ?? 'label', prediction: m.training?.prediction ?? m.inference.outputs[0], rank };
}

function shapeOf(n) {
  return names().rank === 4 ? [n, 1, 8, 8] : [n, data.features];
}

/** Test accuracy and the predicted class of every test digit. */
async function evaluate() {
  const { input, prediction } = names();
  const X = new ort.Tensor('float32', data.test.X, shapeOf(data.test.n));
  const logits = (await sess.run({ [input]: X }, { outputs: [prediction] }))[prediction];
  const classes = logits.dims[1];
  const predicted = new Int32Array(data.test.n);
  let right = 0;
  for (let i = 0; i < data.test.n; i++) {
    let best = 0;
    for (let c = 1; c < classes; c++) if (logits.data[i * classes + c] > logits.data[i * classes + best]) best = c;
    predicted[i] = best;
    if (BigInt(best) === data.test.y[i]) right += 1;
  }
  return { accuracy: right / data.test.n, predicted };
}

// ------------------------------------------------------------------ drawing
function drawChart() {
  const c = ui.chart;
  const g = c.getContext('2d');
  const W = c.width;
  const H = c.height;
  const pad = { l: 46, r: 46, t: 14, b: 30 };
  g.clearRect(0, 0, W, H);
  g.font = '12px system-ui, sans-serif';
  const steps = history.steps;
  const maxLoss = Math.max(0.5, ...steps.slice(0, 50).map((s) => s.loss), ...steps.map((s) => s.loss).slice(-1));
  const total = Math.max(steps.length, 10);
  const x = (i) => pad.l + (i / total) * (W - pad.l - pad.r);
  const y = (v) => pad.t + (1 - Math.min(v, maxLoss) / maxLoss) * (H - pad.t - pad.b);
  const ya = (a) => pad.t + (1 - a) * (H - pad.t - pad.b);
  // axes and grid
  g.strokeStyle = '#e3e7ee';
  g.fillStyle = '#5a6475';
  for (let k = 0; k <= 4; k++) {
    const v = (maxLoss * k) / 4;
    g.beginPath(); g.moveTo(pad.l, y(v)); g.lineTo(W - pad.r, y(v)); g.stroke();
    g.textAlign = 'right'; g.fillText(v.toFixed(2), pad.l - 6, y(v) + 4);
    g.textAlign = 'left'; g.fillText(`${25 * k}%`, W - pad.r + 6, ya(k / 4) + 4);
  }
  g.textAlign = 'center';
  g.fillText(`training steps (${steps.length})`, (pad.l + W - pad.r) / 2, H - 8);
  g.save(); g.translate(12, H / 2); g.rotate(-Math.PI / 2); g.fillStyle = '#2f6fdb'; g.fillText('loss', 0, 0); g.restore();
  g.save(); g.translate(W - 8, H / 2); g.rotate(Math.PI / 2); g.fillStyle = '#1e8e3e'; g.fillText('test accuracy', 0, 0); g.restore();
  // the loss of every step, then each epoch's mean
  g.strokeStyle = 'rgba(47, 111, 219, 0.45)';
  g.lineWidth = 1;
  g.beginPath();
  steps.forEach((s, i) => (i ? g.lineTo(x(i + 1), y(s.loss)) : g.moveTo(x(i + 1), y(s.loss))));
  g.stroke();
  g.strokeStyle = '#2f6fdb';
  g.fillStyle = '#2f6fdb';
  g.lineWidth = 2;
  g.beginPath();
  history.epochs.forEach((e, i) => (i ? g.lineTo(x(e.step), y(e.loss)) : g.moveTo(x(e.step), y(e.loss))));
  g.stroke();
  // test accuracy after each epoch
  g.strokeStyle = '#1e8e3e';
  g.fillStyle = '#1e8e3e';
  g.beginPath();
  history.accuracy.forEach((a, i) => (i ? g.lineTo(x(a.step), ya(a.accuracy)) : g.moveTo(x(a.step), ya(a.accuracy))));
  g.stroke();
  for (const a of history.accuracy) { g.beginPath(); g.arc(x(a.step), ya(a.accuracy), 3, 0, 2 * Math.PI); g.fill(); }
  g.lineWidth = 1;
}

function drawDigits(predicted) {
  const c = ui.digits;
  const g = c.getContext('2d');
  g.clearRect(0, 0, c.width, c.height);
  g.font = 'bold 13px system-ui, sans-serif';
  g.textAlign = 'center';
  const size = 4;
  const cell = 8 * size + 8;
  const perRow = Math.floor(c.width / cell);
  for (let i = 0; i < perRow * 3 && i < data.test.n; i++) {
    const ox = (i % perRow) * cell + 4;
    const oy = Math.floor(i / perRow) * (cell + 12) + 4;
    for (let p = 0; p < 64; p++) {
      const v = 255 - Math.round(255 * data.test.X[i * 64 + p]);
      g.fillStyle = `rgb(${v},${v},${v})`;
      g.fillRect(ox + (p % 8) * size, oy + Math.floor(p / 8) * size, size, size);
    }
    if (predicted) {
      g.fillStyle = BigInt(predicted[i]) === data.test.y[i] ? '#1e8e3e' : '#b3261e';
      g.fillText(String(predicted[i]), ox + 4 * size, oy + 8 * size + 13);
    }
  }
}

async function show() {
  const { accuracy, predicted } = await evaluate();
  ui.accuracy.textContent = `${(100 * accuracy).toFixed(1)}%`;
  drawDigits(predicted);
  return accuracy;
}

// ------------------------------------------------------------------ training
async function train() {
  const epochs = Number(ui.epochs.value);
  const batchSize = Number(ui.batch.value);
  if (ui.lr.value !== '' && !ui.lr.disabled) sess.learningRate = Number(ui.lr.value);
  const { input, target } = names();
  const start = sess.fitPosition?.epoch ?? 0;
  controller = new AbortController();
  setBusy(true);
  document.body.dataset.state = 'training';
  let t0 = performance.now();
  let evaluating = 0; // ms spent on the test set, left out of the step time
  let frame = 0;
  const result = await sess.fit({
    [input]: { data: data.train.X, shape: shapeOf(data.train.n) },
    [target]: { data: data.train.y, shape: [data.train.n] },
  }, {
    initialEpoch: start,
    epochs: start + epochs,
    batchSize,
    seed: 1,
    signal: controller.signal,
    onStep: ({ epoch, batch, stepsPerEpoch, loss }) => {
      history.steps.push({ loss });
      ui.step.textContent = String(history.steps.length);
      status(`training: epoch ${epoch + 1} of ${start + epochs}, batch ${batch + 1}/${stepsPerEpoch}`);
      if (!frame) frame = requestAnimationFrame(() => { frame = 0; drawChart(); });
    },
    onEpoch: async ({ epoch, loss, steps }) => {
      ui.speed.textContent = ((performance.now() - t0 - evaluating) / steps).toFixed(2);
      history.epochs.push({ step: history.steps.length, loss });
      const started = performance.now();
      const accuracy = await show();
      evaluating += performance.now() - started;
      history.accuracy.push({ step: history.steps.length, accuracy });
      ui.epoch.textContent = String(epoch + 1);
      ui.loss.textContent = loss.toFixed(4);
      drawChart();
    },
  });
  t0 = performance.now() - t0;
  setBusy(false);
  const last = history.accuracy.at(-1)?.accuracy ?? 0;
  status(`${result.stoppedEarly ? 'stopped' : 'done'}: ${result.steps} steps in ${(t0 / 1000).toFixed(1)} s; ` +
    `test accuracy ${(100 * last).toFixed(1)}%. Download the trained model below, or train on.`);
  document.body.dataset.state = 'done';
  window.onnxtrainDemo = { accuracy: last, steps: history.steps.length, losses: history.epochs.map((e) => e.loss), position: sess.fitPosition };
}

function setBusy(busy) {
  ui.train.disabled = busy;
  ui.reset.disabled = busy;
  ui.stop.disabled = !busy;
  ui.dlModel.disabled = busy;
  ui.dlState.disabled = busy;
  ui.dlConstants.disabled = busy;
}

async function download(name) {
  const files = await sess.bundleFiles();
  const url = URL.createObjectURL(new Blob([files[name]], { type: 'application/octet-stream' }));
  const a = document.createElement('a');
  a.href = url;
  a.download = name;
  a.click();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

async function reset() {
  await sess.release();
  sess = await TrainingSession.load(ort, initialFiles);
  history.steps.length = 0;
  history.epochs.length = 0;
  history.accuracy.length = 0;
  ui.epoch.textContent = '0';
  ui.step.textContent = '0';
  ui.loss.textContent = '–';
  drawChart();
  await show();
  status('weights reset to the bundle\'s');
}

async function main() {
  try {
    [data, sess] = await Promise.all([loadDigits(), TrainingSession.load(ort, 'bundle')]);
  } catch (err) {
    status(`could not load the bundle or the digits (run python examples/web/prepare.py first): ${err.message}`, true);
    throw err;
  }
  initialFiles = await sess.bundleFiles();
  try {
    ui.lr.value = String(Number(sess.learningRate.toPrecision(6)));
  } catch {
    ui.lr.disabled = true; // the bundle has no learning-rate state variable
  }
  drawChart();
  await show();
  ui.train.onclick = () => train().catch((err) => { status(`training failed: ${err.message}`, true); setBusy(false); });
  ui.stop.onclick = () => controller?.abort();
  ui.reset.onclick = () => reset().catch((err) => status(err.message, true));
  ui.dlModel.onclick = () => download(sess.manifest.inference_model);
  ui.dlState.onclick = () => download(sess.manifest.state_file);
  // inference.onnx reads constants.bin too where the bundle keeps frozen weights
  // there (LoRA): its external-data location names the file.
  const constants = sess.manifest.constants_file;
  const location = new TextEncoder().encode(constants ?? '\0');
  const model = initialFiles[sess.manifest.inference_model];
  ui.dlConstants.hidden = !constants || !model.some((_, i) => location.every((b, j) => model[i + j] === b));
  ui.dlConstants.onclick = () => download(constants);
  setBusy(false);
  status(`ready: ${data.train.n} training and ${data.test.n} test digits, ${sess.stateNames.length} state variables, ` +
    `onnxruntime-web ${ort.env.versions.web} (${ort.env.wasm.numThreads} thread${ort.env.wasm.numThreads > 1 ? 's' : ''})`);
  document.body.dataset.state = 'ready';
}

main();
