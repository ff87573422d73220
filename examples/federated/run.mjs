// Federated averaging with onnxtrain bundles, as Flower users run it: a
// server (server.mjs) and N clients (client.mjs), each its own Node process
// that trains on its own shard of the digits; after every round the server
// averages the clients' model variables (fedavg.mjs says which, and what
// happens to optimizer state) and sends the average back.
//
//   python examples/web/prepare.py --bundle-only --out /tmp/fed          # a digits classifier bundle
//   node examples/federated/run.mjs /tmp/fed/bundle -o /tmp/fed/global   # 2 clients, 5 rounds
//
// Options: --clients N (2), --rounds R (5), --local-epochs E (1),
// --batch-size B (32), --rows R (training rows per client; default: equal
// shards of all of them), --no-shuffle, --overwrite.

import { spawn } from 'node:child_process';
import { readFileSync, readdirSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import { TrainingSession, accuracy, loadDigits, ort, takeRows } from '../node_common.mjs';
import { shards } from './fedavg.mjs';
import { startServer } from './server.mjs';

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    output: { type: 'string', short: 'o' },
    clients: { type: 'string', default: '2' },
    rounds: { type: 'string', default: '5' },
    'local-epochs': { type: 'string', default: '1' },
    'batch-size': { type: 'string', default: '32' },
    rows: { type: 'string' },
    'no-shuffle': { type: 'boolean', default: false },
    overwrite: { type: 'boolean', default: false },
  },
});
if (positionals.length !== 1) {
  console.error('usage: node examples/federated/run.mjs BUNDLE [-o OUT] [--clients N] [--rounds R] [--local-epochs E] [--batch-size B] [--rows R] [--no-shuffle]');
  process.exit(2);
}
const bundle = path.resolve(positionals[0]);
const clients = Number(values.clients);
const rounds = Number(values.rounds);
const files = Object.fromEntries(readdirSync(bundle).map((name) => [name, new Uint8Array(readFileSync(path.join(bundle, name)))]));
const stateFile = JSON.parse(new TextDecoder().decode(files['manifest.json'])).state_file;

// The server's view of the global model: test accuracy after every round.
const digits = loadDigits();
const split = shards(digits.y.shape[0], clients, values.rows ? Number(values.rows) : undefined);
const test = { X: takeRows(digits.X, split.test), y: takeRows(digits.y, split.test) };
async function globalAccuracy(state) {
  const sess = await TrainingSession.load(ort, { ...files, [stateFile]: state });
  const result = await accuracy(sess, test.X, test.y);
  await sess.release();
  return result;
}

const server = await startServer({
  files, clients, rounds,
  onRound: async (r, state, updates) => {
    const losses = [...updates].sort((a, b) => a.client - b.client).map((u) => u.loss.toFixed(4));
    console.log(`round ${r + 1}/${rounds}: clients' local loss ${losses.join(', ')}; ` +
      `global test accuracy ${(100 * await globalAccuracy(state)).toFixed(1)}%`);
  },
});
console.log(`server on ${server.url}: ${clients} clients x ${split.clients[0].length} rows, ${rounds} rounds; ` +
  `test accuracy before: ${(100 * await globalAccuracy(files[stateFile])).toFixed(1)}%`);

const client = fileURLToPath(new URL('./client.mjs', import.meta.url));
const children = Array.from({ length: clients }, (_, k) => new Promise((resolve, reject) => {
  const args = [client, server.url, '--client', String(k), '--clients', String(clients),
    '--local-epochs', values['local-epochs'], '--batch-size', values['batch-size'],
    '--shuffle', values['no-shuffle'] ? 'false' : 'true', ...(values.rows ? ['--rows', values.rows] : [])];
  const child = spawn(process.execPath, args, { stdio: ['ignore', 'inherit', 'inherit'] });
  child.on('exit', (code) => (code === 0 ? resolve() : reject(new Error(`client ${k} exited ${code}`))));
}));
const [state] = await Promise.all([server.done, ...children]);
await server.close();

const global = await TrainingSession.load(ort, { ...files, [stateFile]: state });
const output = path.resolve(values.output ?? `${bundle}-federated`);
await global.save(output, { overwrite: values.overwrite });
console.log(`saved the global model after ${rounds} rounds to ${output}`);
