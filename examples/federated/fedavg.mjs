// Federated averaging (FedAvg, as Flower's FedAvg strategy does it) over
// onnxtrain bundles: the pieces the server and the clients share.
//
// What is averaged: the model's variables, i.e. the state variables the
// inference program reads (trainable parameters and, where the model has
// them, BatchNormalization's running statistics), each the mean of the
// clients' values weighted by their number of training rows.
// What is not: optimizer state (momentum, Adam moments), step counters and
// the learning rate stay the server's. Every round each client starts from
// the server's bundle, so its optimizer starts afresh (zero moments, step 0)
// as a Flower client that builds its optimizer in fit() does.

/** The names of the averaged variables: floating-point state the inference program reads. */
export function modelVariables(manifest) {
  const read = new Set(manifest.inference.state_inputs);
  return manifest.state.filter((v) => read.has(v.name) && /^float(16|32|64)$/.test(v.dtype) && v.dtype !== 'float16').map((v) => v.name);
}

const ARRAYS = { float32: Float32Array, float64: Float64Array };

/**
 * The averaged state.bin: `base` (the server's state.bin bytes) with every
 * model variable replaced by the row-weighted mean of the clients'
 * `updates` ([{ bytes: state.bin of the client, rows }]).  Sums run in
 * float64.
 */
export function average(manifest, base, updates) {
  if (!updates.length) throw new Error('average: no client update');
  const total = updates.reduce((sum, u) => sum + u.rows, 0);
  const out = new Uint8Array(base);
  for (const name of modelVariables(manifest)) {
    const v = manifest.state.find((s) => s.name === name);
    const Array = ARRAYS[v.dtype];
    const count = v.length / Array.BYTES_PER_ELEMENT;
    const sum = new Float64Array(count);
    for (const u of updates) {
      if (u.bytes.byteLength !== manifest.state_bytes) {
        throw new Error(`average: a client sent ${u.bytes.byteLength} bytes of state, expected ${manifest.state_bytes}`);
      }
      const values = new Array(u.bytes.buffer, u.bytes.byteOffset + v.offset, count);
      const weight = u.rows / total;
      for (let i = 0; i < count; i++) sum[i] += weight * values[i];
    }
    new Array(out.buffer, out.byteOffset + v.offset, count).set(sum);
  }
  return out;
}

/**
 * The digits split for the federation: the first 80% of the rows (file
 * order) train, the rest test; client k of K gets the k-th of K equal
 * contiguous shards of the training rows (`rowsPerClient` of them, default
 * all it can have).
 */
export function shards(rows, clients, rowsPerClient) {
  const train = Math.round(rows * 0.8);
  const size = rowsPerClient ?? Math.floor(train / clients);
  if (size * clients > train) throw new Error(`shards: ${clients} clients x ${size} rows exceed the ${train} training rows`);
  const range = (a, b) => Array.from({ length: b - a }, (_, i) => a + i);
  return {
    clients: Array.from({ length: clients }, (_, k) => range(k * size, (k + 1) * size)),
    test: range(train, rows),
  };
}
