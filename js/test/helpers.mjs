// Shared by the tests: Python's fixtures (made once per `node --test` run),
// the onnxruntime modules, and comparisons.

import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, readFileSync, readdirSync, renameSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const JS_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
export const REPO = path.resolve(JS_ROOT, '..');

/** The Python that has onnxtrain: $ONNXTRAIN_PYTHON, the repository's .venv, or python3. */
export function python() {
  if (process.env.ONNXTRAIN_PYTHON) return process.env.ONNXTRAIN_PYTHON;
  const venv = path.join(REPO, '.venv', 'bin', 'python');
  return existsSync(venv) ? venv : 'python3';
}

/** Run a Python script of the repository; throws with its output when it fails. */
export function runPython(args, options = {}) {
  const result = spawnSync(python(), args, { cwd: REPO, encoding: 'utf8', ...options });
  if (result.status !== 0) {
    throw new Error(`${python()} ${args.join(' ')} failed (${result.error?.message ?? `exit ${result.status}`}):\n${result.stdout}\n${result.stderr}`);
  }
  return result.stdout;
}

/**
 * The fixtures of make_fixtures.py: made once per test run (the test
 * files of one `node --test` share its process id as their parent's) in the
 * temporary folder, or read from $ONNXTRAIN_JS_FIXTURES when set.
 */
export function fixtures() {
  let dir = process.env.ONNXTRAIN_JS_FIXTURES;
  if (!dir) {
    const script = readFileSync(path.join(JS_ROOT, 'test', 'make_fixtures.py'));
    const key = createHash('sha256').update(script).update(String(process.ppid)).digest('hex').slice(0, 16);
    dir = path.join(tmpdir(), `onnxtrain-js-fixtures-${key}`);
    cleanOld(dir);
  }
  if (!existsSync(path.join(dir, 'cases.json'))) {
    const temp = `${dir}.tmp-${process.pid}`;
    rmSync(temp, { recursive: true, force: true });
    runPython([path.join(JS_ROOT, 'test', 'make_fixtures.py'), temp]);
    try {
      renameSync(temp, dir);
    } catch (err) {
      rmSync(temp, { recursive: true, force: true }); // another test file made them first
      if (!existsSync(path.join(dir, 'cases.json'))) throw err;
    }
  }
  return { dir, cases: JSON.parse(readFileSync(path.join(dir, 'cases.json'), 'utf8')) };
}

/** Remove fixture folders of earlier runs (older than an hour). */
function cleanOld(current) {
  const root = path.dirname(current);
  for (const name of readdirSync(root)) {
    if (!name.startsWith('onnxtrain-js-fixtures-')) continue;
    const full = path.join(root, name);
    if (full === current) continue;
    try {
      if (Date.now() - statSync(full).mtimeMs > 3600e3) rmSync(full, { recursive: true, force: true });
    } catch { /* another run's: leave it */ }
  }
}

const ARRAYS = {
  float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array,
  uint8: Uint8Array, bool: Uint8Array, int8: Int8Array,
};

/** A fixture array ({ file, dtype, shape }) as an ort.Tensor. */
export function readTensor(ort, dir, spec) {
  const bytes = readFileSync(path.join(dir, spec.file));
  const copy = new Uint8Array(bytes.byteLength);
  copy.set(bytes);
  const Array = ARRAYS[spec.dtype];
  return new ort.Tensor(spec.dtype, new Array(copy.buffer, 0, copy.byteLength / Array.BYTES_PER_ELEMENT), spec.shape);
}

/** The onnxruntime modules the tests run on. */
export async function runtimes() {
  const node = await import('onnxruntime-node');
  const web = await import('onnxruntime-web');
  web.env.wasm.numThreads = 1;
  return { node, web };
}

/** The largest |a - b| / (atol + rtol |b|) over two numeric arrays (<= 1 passes). */
export function closeness(a, b, rtol = 1e-4, atol = 1e-5) {
  if (a.length !== b.length) return Infinity;
  let worst = 0;
  for (let i = 0; i < a.length; i++) {
    const x = Number(a[i]);
    const y = Number(b[i]);
    if (Number.isNaN(x) || Number.isNaN(y)) return Infinity;
    worst = Math.max(worst, Math.abs(x - y) / (atol + rtol * Math.abs(y)));
  }
  return worst;
}

/** The bytes of a typed array, for exact comparison. */
export function bytes(data) {
  return Buffer.from(data.buffer, data.byteOffset, data.byteLength);
}
