// fit: epochs over arrays, in batches, with a progress callback; the same
// loop as Python's TrainingSession.fit (the cycle of algorithms continues
// across epochs, the loss mean is weighted by rows, fitPosition follows every
// batch), without its validation and metrics.

import { sizeOf, toTypedArray } from './dtypes.js';

/**
 * Train `session` on `data`: { feedName: { data, shape } | ort.Tensor }, rows
 * on axis 0.  Options: epochs (the epoch to stop at, as in Python and Keras),
 * batchSize, shuffle, seed, dropLast, cycle (algorithm index per batch,
 * null = every algorithm; default: the bundle's training.cycle), initialEpoch
 * (default: the loaded bundle's fit position), loss (the output to average),
 * onStep(info), onEpoch(info), signal (an AbortSignal that stops after the
 * current step).  Returns { loss: [mean per epoch], epochs, steps, stoppedEarly }.
 */
export async function fit(session, data, options = {}) {
  const o = { epochs: 1, batchSize: 32, shuffle: true, seed: 0, ...options };
  const caller = 'fit';
  const manifest = session.manifest;
  const n = manifest.algorithms.length;
  if (n === 0) throw new Error('fit: the bundle has no algorithm: there is nothing to train');
  if (!Number.isInteger(o.batchSize) || o.batchSize < 1) {
    throw new RangeError(`fit: batchSize must be a whole number >= 1, got ${o.batchSize}`);
  }
  if (!Number.isInteger(o.epochs) || o.epochs < 0) {
    throw new RangeError(`fit: epochs must be a whole number >= 0, got ${o.epochs}`);
  }
  const cycle = o.cycle ?? manifest.training?.cycle ?? [null];
  if (!Array.isArray(cycle) || !cycle.length
    || !cycle.every((i) => i === null || (Number.isInteger(i) && i >= 0 && i < n))) {
    throw new RangeError(`fit: cycle must list algorithm indices in [0, ${n}) or null, got ${JSON.stringify(cycle)}`);
  }
  const columns = dataColumns(manifest, data, caller);
  const rows = columns[0].shape[0];
  const fixed = fixedBatch(manifest, columns);
  if (fixed !== null && o.batchSize !== fixed) {
    throw new RangeError(`fit: the model's inputs have a fixed batch dimension of ${fixed}; pass batchSize: ${fixed} (got ${o.batchSize})`);
  }
  const dropLast = o.dropLast ?? fixed !== null;
  if (dropLast && rows < o.batchSize) {
    throw new RangeError(`fit: dropLast with ${rows} rows and batchSize ${o.batchSize} leaves no batch`);
  }
  const perEpoch = dropLast ? Math.floor(rows / o.batchSize) : Math.ceil(rows / o.batchSize);
  const lossName = o.loss ?? manifest.training?.loss ?? 'loss';

  const position = session.fitPosition;
  let initialEpoch = o.initialEpoch;
  let skip = 0;
  if (initialEpoch === undefined) {
    const resume = position !== null && session.positionSource === 'bundle';
    initialEpoch = resume ? position.epoch : 0;
    skip = resume ? position.batch : 0;
  }
  if (!Number.isInteger(initialEpoch) || initialEpoch < 0) {
    throw new RangeError(`fit: initialEpoch must be a whole number >= 0, got ${initialEpoch}`);
  }
  // The cycle position continues across epochs, and across a resume.
  let cyclePos = initialEpoch * perEpoch + skip;
  const baseStep = (skip || initialEpoch) && position !== null ? position.step : cyclePos;
  const Tensor = session.ort.Tensor;
  const history = { loss: [], epochs: [], steps: 0, stoppedEarly: false };
  let step = 0;
  let lastYield = now();
  for (let epoch = initialEpoch; epoch < o.epochs; epoch++) {
    const start = now();
    const order = o.shuffle ? permutation(rows, o.seed, epoch) : null;
    let total = 0;
    let weight = 0;
    const first = epoch === initialEpoch ? skip : 0;
    for (let i = first; i < perEpoch; i++) {
      if (o.signal?.aborted) {
        history.stoppedEarly = true;
        break;
      }
      const begin = i * o.batchSize;
      const end = Math.min(begin + o.batchSize, rows);
      const feeds = {};
      for (const c of columns) feeds[c.name] = new Tensor(c.dtype, takeRows(c, order, begin, end), [end - begin, ...c.shape.slice(1)]);
      const algorithm = cycle[cyclePos % cycle.length];
      const out = await session.trainStep(feeds, algorithm === null ? {} : { algorithm });
      cyclePos += 1;
      step += 1;
      session.fitPosition = { epoch, batch: i + 1, step: baseStep + step };
      const info = { epoch, batch: i, step, size: end - begin, stepsPerEpoch: perEpoch };
      if (out[lossName] !== undefined) {
        info.loss = meanOf(out[lossName].data);
        if (!Number.isFinite(info.loss)) {
          throw new Error(`fit: the training loss is ${info.loss} at epoch ${epoch + 1}, batch ${i + 1} ` +
            `(step ${step} of this run); training stopped. The step was committed: the state holds the parameters after it`);
        }
        total += info.loss * info.size;
        weight += info.size;
      }
      await o.onStep?.(info);
      if (now() - lastYield > 40) { // let a page draw (and timers run) during long epochs
        await new Promise((resolve) => setTimeout(resolve, 0));
        lastYield = now();
      }
    }
    if (history.stoppedEarly) break;
    session.fitPosition = { epoch: epoch + 1, batch: 0, step: baseStep + step };
    const loss = weight ? total / weight : NaN;
    history.loss.push(loss);
    history.epochs.push(epoch);
    history.steps = step;
    await o.onEpoch?.({ epoch, loss, steps: step, seconds: (now() - start) / 1000 });
  }
  history.steps = step;
  return history;
}

function now() {
  return globalThis.performance?.now?.() ?? Date.now();
}

/** The training feeds the bundle's algorithms read: name -> { dtype, shape }. */
function trainingFeeds(manifest) {
  const specs = new Map();
  for (const a of manifest.algorithms) {
    for (const f of [...(a.feeds ?? []), ...(a.optional_feeds ?? [])]) if (!specs.has(f.name)) specs.set(f.name, f);
  }
  return specs;
}

/** The data as columns { name, dtype, values, shape, rowSize }, checked against the feeds. */
function dataColumns(manifest, data, caller) {
  if (data === null || typeof data !== 'object' || Array.isArray(data)) {
    throw new TypeError(`${caller}: data must be an object of feed name -> { data, shape } (rows on axis 0)`);
  }
  const specs = trainingFeeds(manifest);
  const columns = Object.entries(data).map(([name, value]) => {
    const spec = specs.get(name);
    if (spec === undefined) {
      throw new Error(`${caller}: unknown feed '${name}'; the training feeds are [${[...specs.keys()].map((k) => `'${k}'`).join(', ')}]`);
    }
    const where = `${caller}: feed '${name}'`;
    const values = value?.data;
    let shape = value?.shape ?? value?.dims;
    if (shape === undefined && values?.length !== undefined && spec.shape?.length === 1) shape = [values.length];
    if (!Array.isArray(shape) && !ArrayBuffer.isView(shape)) {
      throw new TypeError(`${where}: give { data, shape } (rows on axis 0) or an ort.Tensor`);
    }
    shape = Array.from(shape, Number);
    const typed = toTypedArray(spec.dtype, values, where);
    if (shape.length === 0 || sizeOf(shape) !== typed.length) {
      throw new RangeError(`${where}: shape [${shape.join(', ')}] does not fit ${typed.length} values (rows on axis 0)`);
    }
    const rest = spec.shape === null ? null : spec.shape.slice(1);
    if (rest !== null && (rest.length !== shape.length - 1 || rest.some((d, a) => Number.isInteger(d) && shape[a + 1] !== d))) {
      throw new RangeError(`${where}: rows of shape [${shape.slice(1).join(', ')}] do not fit the feed's [${spec.shape.join(', ')}]`);
    }
    return { name, dtype: spec.dtype, values: typed, shape, rowSize: sizeOf(shape.slice(1)) };
  });
  if (!columns.length) throw new Error(`${caller}: data holds no feed`);
  const counts = new Set(columns.map((c) => c.shape[0]));
  if (counts.size > 1) {
    throw new RangeError(`${caller}: the feeds have different numbers of rows: ${columns.map((c) => `${c.name} ${c.shape[0]}`).join(', ')}`);
  }
  return columns;
}

/** A static batch dimension of the data's feeds, or null. */
function fixedBatch(manifest, columns) {
  const specs = trainingFeeds(manifest);
  for (const c of columns) {
    const d = specs.get(c.name).shape?.[0];
    if (Number.isInteger(d)) return d;
  }
  return null;
}

/** Rows [begin, end) of a column (in `order` when shuffled), as a new typed array. */
function takeRows(column, order, begin, end) {
  const size = column.rowSize;
  if (order === null) return column.values.slice(begin * size, end * size);
  const out = new column.values.constructor((end - begin) * size);
  for (let j = begin; j < end; j++) {
    const r = order[j];
    out.set(column.values.subarray(r * size, (r + 1) * size), (j - begin) * size);
  }
  return out;
}

function meanOf(values) {
  let total = 0;
  for (let i = 0; i < values.length; i++) total += Number(values[i]);
  return total / values.length;
}

/**
 * A permutation of 0..n-1 that depends only on (seed, epoch): Fisher-Yates
 * driven by mulberry32.  (Not numpy's order: JavaScript and Python shuffle
 * differently; pass shuffle: false to replay Python's batches.)
 */
export function permutation(n, seed, epoch) {
  let state = (Math.imul(seed >>> 0, 0x9e3779b1) ^ Math.imul((epoch + 1) >>> 0, 0x85ebca6b)) >>> 0;
  const random = () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = state;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const order = new Uint32Array(n);
  for (let i = 0; i < n; i++) order[i] = i;
  for (let i = n - 1; i > 0; i--) {
    const j = Math.floor(random() * (i + 1));
    const t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  return order;
}
