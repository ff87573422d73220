// Fine-tune a training bundle on Node with the JavaScript package, print the
// progress, save the trained bundle (Python's onnxtrain.bundle.load reads it).
//
//   python examples/web/prepare.py --bundle-only --out /tmp/digits   # a digits classifier bundle
//   node examples/node_finetune.mjs /tmp/digits/bundle -o /tmp/digits-trained
//
// The data are the 8x8 digits that ship with the Python package
// (onnxtrain/data/digits.npz). Any digits classifier bundle works: its input
// may be [N, 64] pixels or [N, 1, 8, 8] images.
//
// The package and onnxruntime-node come through node_common.mjs (from js/ in
// the repository; in your own project import them by name).

import path from 'node:path';
import { parseArgs } from 'node:util';

import { TrainingSession, accuracy, asInput, loadDigits, namesOf, ort, permutation, takeRows } from './node_common.mjs';

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    output: { type: 'string', short: 'o' },
    epochs: { type: 'string', default: '5' },
    'batch-size': { type: 'string', default: '32' },
    lr: { type: 'string' },
    overwrite: { type: 'boolean', default: false },
    quick: { type: 'boolean', default: false },
  },
});
if (positionals.length !== 1) {
  console.error('usage: node examples/node_finetune.mjs BUNDLE [-o OUT] [--epochs N] [--batch-size B] [--lr R] [--overwrite] [--quick]');
  process.exit(2);
}
const bundle = path.resolve(positionals[0]);
const output = path.resolve(values.output ?? `${bundle}-finetuned`);

const sess = await TrainingSession.load(ort, bundle);
const { input, target } = namesOf(sess);

// The digits, split 80/20 with a fixed shuffle.
const digits = loadDigits();
const order = permutation(digits.y.shape[0], 0, 0);
const nTest = Math.round(order.length * 0.2);
const train = { [input]: asInput(sess, takeRows(digits.X, order.subarray(nTest))), [target]: takeRows(digits.y, order.subarray(nTest)) };
const test = { X: takeRows(digits.X, order.subarray(0, nTest)), y: takeRows(digits.y, order.subarray(0, nTest)) };
const testAccuracy = async () => `${(100 * await accuracy(sess, test.X, test.y)).toFixed(1)}%`;

if (values.lr !== undefined) sess.learningRate = Number(values.lr);
const epochs = values.quick ? 1 : Number(values.epochs);
console.log(`bundle ${bundle}: ${sess.numAlgorithms} algorithm(s), ${sess.stateNames.length} state variables`);
console.log(`digits: ${train[input].shape[0]} for training, ${nTest} for testing; ` +
  `test accuracy before: ${await testAccuracy()}`);
const start = performance.now();
const interactive = process.stdout.isTTY;
const result = await sess.fit(train, {
  epochs: (sess.fitPosition?.epoch ?? 0) + epochs,
  batchSize: Number(values['batch-size']),
  seed: 1,
  onStep: ({ epoch, batch, stepsPerEpoch, loss }) => {
    if (interactive) process.stdout.write(`\repoch ${epoch + 1} batch ${batch + 1}/${stepsPerEpoch} loss ${loss.toFixed(4)}  `);
  },
  onEpoch: async ({ epoch, loss, seconds }) => {
    if (interactive) process.stdout.write('\r');
    console.log(`epoch ${epoch + 1}: mean loss ${loss.toFixed(4)}, test accuracy ${await testAccuracy()} (${seconds.toFixed(2)} s)`);
  },
});
const steps = result.steps;
console.log(`${steps} steps in ${((performance.now() - start) / 1000).toFixed(1)} s ` +
  `(${((performance.now() - start) / steps).toFixed(2)} ms/step); fit position ${JSON.stringify(sess.fitPosition)}`);
await sess.save(output, { overwrite: values.overwrite });
console.log(`saved the trained bundle to ${output}`);
