// The federation's server: an HTTP server on 127.0.0.1 that hands out the
// global bundle of each round and averages what the clients send back.
//
//   GET  /round/R/FILE            a file of round R's global bundle (waits until round R exists)
//   POST /round/R/update?rows=N&client=K&loss=L   client K's trained state.bin for round R
//                                 (N training rows; L its last local loss, for the log)
//   GET  /status                  { round, rounds }
//
// Round R's bundle is the starting bundle with the averaged state of round
// R - 1 (round 0: the starting state).  After `rounds` rounds, `done` resolves
// with the final state.bin.

import { createServer } from 'node:http';

import { average } from './fedavg.mjs';

export async function startServer({ files, clients, rounds, onRound }) {
  const manifest = JSON.parse(new TextDecoder().decode(files['manifest.json']));
  const states = [files[manifest.state_file]]; // states[r]: the global state.bin of round r
  const waiting = []; // [round, resolve]: requests for a round not reached yet
  let updates = [];
  let finish;
  const done = new Promise((resolve) => { finish = resolve; });

  const roundReady = (r) => new Promise((resolve) => {
    if (r < states.length) resolve();
    else waiting.push([r, resolve]);
  });

  async function receive(r, params, body, res) {
    if (r !== states.length - 1 || r >= rounds) {
      res.writeHead(409).end(`round ${r} is not open (the open round is ${states.length - 1})`);
      return;
    }
    updates.push({ bytes: body, rows: Number(params.get('rows')), client: Number(params.get('client')), loss: Number(params.get('loss')) });
    res.writeHead(204).end();
    if (updates.length < clients) return;
    const next = average(manifest, states[r], updates);
    await onRound?.(r, next, updates);
    updates = [];
    states.push(next);
    for (const [wanted, resolve] of waiting.splice(0)) {
      if (wanted < states.length) resolve();
      else waiting.push([wanted, resolve]);
    }
    if (states.length - 1 === rounds) finish(next);
  }

  const server = createServer((req, res) => {
    const url = new URL(req.url, 'http://127.0.0.1');
    const m = /^\/round\/(\d+)\/(.+)$/.exec(url.pathname);
    if (req.method === 'GET' && url.pathname === '/status') {
      res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ round: states.length - 1, rounds }));
    } else if (req.method === 'GET' && m) {
      const [r, name] = [Number(m[1]), decodeURIComponent(m[2])];
      if (r > rounds || !Object.hasOwn(files, name)) {
        res.writeHead(404).end();
        return;
      }
      roundReady(r).then(() => res.writeHead(200).end(Buffer.from(name === manifest.state_file ? states[r] : files[name])));
    } else if (req.method === 'POST' && m && m[2] === 'update') {
      const chunks = [];
      req.on('data', (c) => chunks.push(c));
      req.on('end', () => {
        const body = new Uint8Array(Buffer.concat(chunks));
        receive(Number(m[1]), url.searchParams, body, res).catch((err) => {
          console.error(err);
          if (!res.headersSent) res.writeHead(500).end(err.message);
        });
      });
    } else {
      res.writeHead(404).end();
    }
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    url: `http://127.0.0.1:${server.address().port}`,
    done,
    close: () => new Promise((resolve) => { server.closeAllConnections?.(); server.close(resolve); }),
  };
}
