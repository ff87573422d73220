// One federated client, in its own process: each round it loads the global
// bundle from the server's URL, trains on its own shard of the digits, and
// sends back its state.bin and its number of rows.
//
//   node examples/federated/client.mjs SERVER_URL --client K --clients N [--local-epochs E] [--batch-size B] [--rows R]

import { parseArgs } from 'node:util';

import { TrainingSession, asInput, loadDigits, namesOf, ort, takeRows } from '../node_common.mjs';
import { shards } from './fedavg.mjs';

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    client: { type: 'string' },
    clients: { type: 'string' },
    'local-epochs': { type: 'string', default: '1' },
    'batch-size': { type: 'string', default: '32' },
    rows: { type: 'string' },
    shuffle: { type: 'string', default: 'true' },
  },
});
const server = positionals[0];
const k = Number(values.client);
const digits = loadDigits();
const split = shards(digits.y.shape[0], Number(values.clients), values.rows ? Number(values.rows) : undefined);
const mine = split.clients[k];

const { rounds } = await (await fetch(`${server}/status`)).json();
for (let round = 0; round < rounds; round++) {
  const sess = await TrainingSession.load(ort, `${server}/round/${round}/`); // waits for the round
  const { input, target } = namesOf(sess);
  const result = await sess.fit({
    [input]: asInput(sess, takeRows(digits.X, mine)),
    [target]: takeRows(digits.y, mine),
  }, {
    epochs: Number(values['local-epochs']),
    initialEpoch: 0,
    batchSize: Number(values['batch-size']),
    shuffle: values.shuffle !== 'false',
    seed: 1000 * round + k,
  });
  const query = `rows=${mine.length}&client=${k}&loss=${result.loss.at(-1)}`;
  const response = await fetch(`${server}/round/${round}/update?${query}`, { method: 'POST', body: sess.stateBytes() });
  if (!response.ok) throw new Error(`client ${k}: the server refused round ${round}'s update: ${await response.text()}`);
  await sess.release();
}
