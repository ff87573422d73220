// The package as published: the browser entry has no node: import anywhere
// in its import graph, `npm pack` holds what it needs (and no tests), the
// versions agree, and the TypeScript declarations fit real onnxruntime
// modules (and reject a wrong use).

import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { test } from 'node:test';

import * as browserEntry from '../src/index.js';
import * as nodeEntry from 'onnxtrain';

import { JS_ROOT } from './helpers.mjs';

const pkg = JSON.parse(readFileSync(path.join(JS_ROOT, 'package.json'), 'utf8'));

/** Every module the file imports, statically or dynamically, followed through relative imports. */
function importGraph(entry) {
  const seen = new Map();
  const visit = (file) => {
    if (seen.has(file)) return;
    const text = readFileSync(file, 'utf8');
    const specifiers = [...text.matchAll(/(?:^|\n)\s*(?:import|export)\s[^'"]*?from\s*['"]([^'"]+)['"]|import\(\s*['"]([^'"]+)['"]\s*\)/g)]
      .map((m) => ({ name: m[1] ?? m[2], dynamic: m[2] !== undefined }));
    seen.set(file, specifiers);
    for (const s of specifiers) if (s.name.startsWith('.')) visit(path.resolve(path.dirname(file), s.name));
  };
  visit(entry);
  return seen;
}

test('the browser entry imports no node: module, statically or dynamically', () => {
  const entry = path.join(JS_ROOT, pkg.exports['.'].browser);
  const graph = importGraph(entry);
  assert.ok(graph.size >= 5, 'the graph was read');
  for (const [file, specifiers] of graph) {
    for (const s of specifiers) assert.ok(!s.name.startsWith('node:') && !['fs', 'path', 'url'].includes(s.name), `${file} imports ${s.name}`);
  }
  // The Node entry imports node: modules only dynamically.
  for (const [file, specifiers] of importGraph(path.join(JS_ROOT, pkg.exports['.'].node))) {
    for (const s of specifiers) if (s.name.startsWith('node:')) assert.ok(s.dynamic, `${file} imports ${s.name} statically`);
  }
  assert.equal(pkg.exports['.']['react-native'], pkg.exports['.'].browser);
  assert.equal(pkg.exports['.'].default, pkg.exports['.'].browser);
});

test('both entries export the same names; VERSION is package.json version', () => {
  assert.deepEqual(Object.keys(browserEntry).sort(), Object.keys(nodeEntry).sort());
  assert.equal(nodeEntry.VERSION, pkg.version);
  assert.ok(nodeEntry.TrainingSession.prototype instanceof browserEntry.TrainingSession);
  assert.equal(pkg.type, 'module');
  assert.deepEqual(pkg.dependencies ?? {}, {}, 'no runtime dependency');
});

test('npm pack holds the sources, the declarations and the README, and no tests', () => {
  const result = spawnSync('npm', ['pack', '--dry-run', '--json', '--ignore-scripts'], { cwd: JS_ROOT, encoding: 'utf8' });
  assert.equal(result.status, 0, result.stderr);
  const files = JSON.parse(result.stdout)[0].files.map((f) => f.path).sort();
  for (const need of ['package.json', 'README.md', 'src/index.js', 'src/node.js', 'src/index.d.ts', 'src/session.js', 'src/fit.js']) {
    assert.ok(files.includes(need), `${need} is packed`);
  }
  assert.deepEqual(files.filter((f) => f.startsWith('test/') || f.startsWith('node_modules/')), []);
});

test('the TypeScript declarations fit onnxruntime-node and -web, and reject a wrong use', () => {
  const tsc = path.join(JS_ROOT, 'node_modules', 'typescript', 'bin', 'tsc');
  const good = spawnSync(process.execPath, [tsc, '-p', path.join(JS_ROOT, 'test', 'types', 'tsconfig.json')], { encoding: 'utf8' });
  assert.equal(good.status, 0, good.stdout + good.stderr);
  const dir = mkdtempSync(path.join(JS_ROOT, 'test', 'types', 'tmp-'));
  try {
    writeFileSync(path.join(dir, 'wrong.ts'), [
      "import * as ort from 'onnxruntime-node';",
      "import { TrainingSession } from 'onnxtrain';",
      'export async function f() {',
      "  const sess = await TrainingSession.load(ort, 'b');",
      '  const n: number = sess.stateBytes();',
      "  await sess.trainStep({ X: 1 });",
      '  return n;',
      '}',
    ].join('\n'));
    writeFileSync(path.join(dir, 'tsconfig.json'), JSON.stringify({ extends: '../tsconfig.json', files: ['wrong.ts'] }));
    const bad = spawnSync(process.execPath, [tsc, '-p', path.join(dir, 'tsconfig.json')], { encoding: 'utf8' });
    assert.notEqual(bad.status, 0);
    assert.match(bad.stdout, /wrong\.ts\(5,\d+\): error TS2322: Type 'Uint8Array.*' is not assignable to type 'number'/);
    assert.match(bad.stdout, /wrong\.ts\(6,\d+\): error TS2322: Type 'number' is not assignable to type 'Tensor'/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
