// Sources (folder, file: URL, http URL, bytes), save and its safety, fit
// from a Python fit checkpoint, and initialize().

import assert from 'node:assert/strict';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:http';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, test } from 'node:test';
import { pathToFileURL } from 'node:url';

import * as ort from 'onnxruntime-node';
import { TrainingSession, permutation } from 'onnxtrain';

import { fixtures, readTensor } from './helpers.mjs';

const { dir, cases } = fixtures();
const scratch = mkdtempSync(path.join(tmpdir(), 'onnxtrain-js-session-'));
after(() => rmSync(scratch, { recursive: true, force: true }));

const mlp = path.join(dir, cases.mlp.bundle);
const feedsOf = (step) => Object.fromEntries(Object.entries(step.feeds).map(([k, s]) => [k, readTensor(ort, dir, s)]));

/** Python's steps of a case replayed; returns the session's state bytes. */
async function replay(sess, c) {
  for (const step of c.steps) {
    if (step.learning_rate !== undefined) sess.learningRate = step.learning_rate;
    await sess.trainStep(feedsOf(step), step.algorithm === null ? {} : { algorithm: step.algorithm });
  }
  return Buffer.from(sess.stateBytes());
}

const expectedState = (c) => readFileSync(path.join(dir, c.after, 'state.bin'));

test('load takes a folder, a file: URL, an http URL (trailing slash optional) and an object of bytes', async () => {
  const files = Object.fromEntries(readdirSync(mlp).map((name) => [name, new Uint8Array(readFileSync(path.join(mlp, name)))]));
  const server = createServer((req, res) => {
    const name = decodeURIComponent(req.url.replace(/^\/bundles\/mlp\//, ''));
    if (!req.url.startsWith('/bundles/mlp/') || !Object.hasOwn(files, name)) {
      res.writeHead(404).end();
      return;
    }
    res.writeHead(200).end(Buffer.from(files[name]));
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const base = `http://127.0.0.1:${server.address().port}/bundles/mlp`;
  try {
    const sources = [mlp, `${mlp}/`, pathToFileURL(mlp), base, `${base}/`, files,
      { ...files, 'manifest.json': JSON.parse(readFileSync(path.join(mlp, 'manifest.json'), 'utf8')) }];
    for (const source of sources) {
      const sess = await TrainingSession.load(ort, source);
      assert.ok(expectedState(cases.mlp).equals(await replay(sess, cases.mlp)), `from ${String(source).slice(0, 60)}`);
    }
    await assert.rejects(TrainingSession.load(ort, `http://127.0.0.1:${server.address().port}/bundles/none`),
      /bundle http:\/\/127\.0\.0\.1:\d+\/bundles\/none\/: missing file manifest\.json/);
  } finally {
    server.close();
  }
});

test('save writes a complete bundle atomically; it loads with the state and fit position', async () => {
  const sess = await TrainingSession.load(ort, mlp);
  await replay(sess, cases.mlp);
  sess.fitPosition = { epoch: 2, batch: 1, step: 13 };
  const folder = path.join(scratch, 'saved');
  assert.equal(await sess.save(folder), folder);
  assert.deepEqual(readdirSync(folder).sort(), readdirSync(mlp).sort());
  assert.ok(readFileSync(path.join(folder, 'state.bin')).equals(expectedState(cases.mlp)));
  const manifest = JSON.parse(readFileSync(path.join(folder, 'manifest.json'), 'utf8'));
  assert.deepEqual(manifest.fit_position, { epoch: 2, batch: 1, step: 13 });
  const again = await TrainingSession.load(ort, folder);
  assert.deepEqual(again.fitPosition, { epoch: 2, batch: 1, step: 13 });
  assert.equal(again.positionSource, 'bundle');
  assert.ok(Buffer.from(again.stateBytes()).equals(expectedState(cases.mlp)));
  assert.equal(readdirSync(scratch).filter((n) => n.includes('.tmp-')).length, 0, 'no temporary folder left');

  // A non-empty folder is refused (nothing changes) unless overwrite; a file is refused.
  const before = readFileSync(path.join(folder, 'state.bin'));
  const fresh = await TrainingSession.load(ort, mlp);
  await assert.rejects(fresh.save(folder), /save: .*saved is a folder that is not empty; pass \{ overwrite: true \} to replace it \(nothing was written\)/);
  assert.ok(readFileSync(path.join(folder, 'state.bin')).equals(before));
  await fresh.save(folder, { overwrite: true });
  assert.ok(readFileSync(path.join(folder, 'state.bin')).equals(readFileSync(path.join(mlp, 'state.bin'))));
  const file = path.join(scratch, 'a-file');
  writeFileSync(file, 'keep me');
  await assert.rejects(fresh.save(file, { overwrite: true }), /exists and is not a folder; nothing was written/);
  assert.equal(readFileSync(file, 'utf8'), 'keep me');
  const empty = path.join(scratch, 'empty');
  mkdirSync(empty);
  await fresh.save(empty);
  assert.ok(existsSync(path.join(empty, 'manifest.json')));
  // Saving over the folder it was loaded from.
  const own = await TrainingSession.load(ort, folder);
  await own.trainStep(feedsOf(cases.mlp.steps[0]));
  await own.save(folder, { overwrite: true });
  assert.ok(readFileSync(path.join(folder, 'state.bin')).equals(Buffer.from(own.stateBytes())));
});

test('bundleFiles gives every file of the bundle; stateBytes replaces state.bin in a copy', async () => {
  const sess = await TrainingSession.load(ort, path.join(dir, cases.lstm.bundle));
  await replay(sess, cases.lstm);
  const files = await sess.bundleFiles();
  assert.deepEqual(Object.keys(files).sort(), readdirSync(path.join(dir, cases.lstm.bundle)).sort());
  const copy = { ...files, 'state.bin': sess.stateBytes() };
  const again = await TrainingSession.load(ort, copy);
  assert.ok(Buffer.from(again.stateBytes()).equals(expectedState(cases.lstm)));
});

test('initialize runs the initialization programs (hand-written TrainingInfoProtos) and resets the position', async () => {
  const c = cases.two_algorithms;
  const sess = await TrainingSession.load(ort, path.join(dir, c.bundle));
  await sess.initialize();
  const trained = await replay(sess, c);
  assert.ok(trained.equals(expectedState(c)));
  sess.fitPosition = { epoch: 1, batch: 0, step: 5 };
  await sess.initialize();
  assert.equal(sess.fitPosition, null);
  assert.ok(Buffer.from(sess.stateBytes()).equals(readFileSync(path.join(dir, c.bundle, 'state.bin'))));
});

test("fit continues a Python fit checkpoint as Python's bundle.load + fit does (gradient accumulation's cycle)", async () => {
  const c = cases.fit;
  const sess = await TrainingSession.load(ort, path.join(dir, c.bundle));
  assert.deepEqual(sess.manifest.training.cycle, [0, 1]);
  const X = readTensor(ort, dir, c.fit.X);
  const label = readTensor(ort, dir, c.fit.label);
  const steps = [];
  const epochs = [];
  const result = await sess.fit({ X: { data: X.data, shape: X.dims }, label: { data: label.data } }, {
    epochs: c.fit.epochs, batchSize: c.fit.batchSize, shuffle: false,
    onStep: (info) => steps.push(info), onEpoch: (info) => epochs.push(info),
  });
  assert.deepEqual(result.epochs, [1, 2]);
  assert.equal(result.loss.length, c.fit.loss.length);
  result.loss.forEach((loss, i) => assert.ok(Math.abs(loss - c.fit.loss[i]) <= 1e-12 * Math.abs(loss), `epoch ${i}: ${loss} vs ${c.fit.loss[i]}`));
  assert.deepEqual(sess.fitPosition, c.fit.position);
  assert.ok(Buffer.from(sess.stateBytes()).equals(expectedState(c)));
  assert.equal(steps.length, 14);
  assert.deepEqual(steps[0], { ...steps[0], epoch: 1, batch: 0, step: 1, size: 16, stepsPerEpoch: 7 });
  assert.equal(steps[6].size, 4);
  assert.equal(epochs.length, 2);
  assert.equal(epochs[1].steps, 14);
  // fit's position goes into the saved manifest.
  const folder = path.join(scratch, 'fitted');
  await sess.save(folder);
  assert.deepEqual(JSON.parse(readFileSync(path.join(folder, 'manifest.json'), 'utf8')).fit_position, c.fit.position);
});

test('fit: shuffle with a seed, dropLast, a signal, and clear errors', async () => {
  const sess = await TrainingSession.load(ort, mlp);
  const rows = 20;
  const X = { data: new Float32Array(rows * 64).map((_, i) => (i % 13) / 13), shape: [rows, 64] };
  const label = { data: Array.from({ length: rows }, (_, i) => i % 10) };
  const seen = [];
  const result = await sess.fit({ X, label }, { epochs: 2, batchSize: 6, dropLast: true, seed: 3, onStep: (s) => seen.push(s) });
  assert.equal(seen.length, 6);
  assert.ok(seen.every((s) => s.size === 6));
  assert.equal(result.loss.length, 2);
  assert.deepEqual(sess.fitPosition, { epoch: 2, batch: 0, step: 6 });
  const order = permutation(20, 3, 0);
  assert.deepEqual([...order].sort((a, b) => a - b), Array.from({ length: 20 }, (_, i) => i));
  assert.deepEqual(permutation(20, 3, 0), order);
  assert.notDeepEqual(permutation(20, 3, 1), order);
  assert.notDeepEqual(permutation(20, 4, 0), order);
  const controller = new AbortController();
  const stopped = await sess.fit({ X, label }, { epochs: 1, batchSize: 4, onStep: () => controller.abort(), signal: controller.signal });
  assert.equal(stopped.steps, 1);
  assert.ok(stopped.stoppedEarly);
  await assert.rejects(sess.fit({ X, labels: label }), /fit: unknown feed 'labels'; the training feeds are \['X', 'label'\]/);
  await assert.rejects(sess.fit({ X: { data: X.data, shape: [rows, 63] }, label }), /fit: feed 'X': shape \[20, 63\] does not fit 1280 values/);
  await assert.rejects(sess.fit({ X: { data: new Float32Array(rows * 8), shape: [rows, 8] }, label }), /fit: feed 'X': rows of shape \[8\] do not fit the feed's \[N, 64\]/);
  await assert.rejects(sess.fit({ X, label: { data: [1, 2] } }), /fit: the feeds have different numbers of rows: X 20, label 2/);
  await assert.rejects(sess.fit({ X, label }, { batchSize: 0 }), /fit: batchSize must be a whole number >= 1, got 0/);
  await assert.rejects(sess.fit({ X, label }, { cycle: [2] }), /fit: cycle must list algorithm indices in \[0, 1\) or null, got \[2\]/);
});

test('steps, runs and state reads may be issued together: they take turns', async () => {
  const c = cases.mlp;
  const sess = await TrainingSession.load(ort, path.join(dir, c.bundle));
  const pending = c.steps.map((step) => {
    if (step.learning_rate !== undefined) return null;
    return sess.trainStep(feedsOf(step));
  });
  await Promise.all(pending);
  const serial = await TrainingSession.load(ort, path.join(dir, c.bundle));
  for (const step of c.steps) if (step.learning_rate === undefined) await serial.trainStep(feedsOf(step));
  assert.ok(Buffer.from(sess.stateBytes()).equals(Buffer.from(serial.stateBytes())));
});
