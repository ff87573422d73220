// Compiled by `tsc -p test/types` (package.test.mjs): the declarations fit
// real onnxruntime modules and the documented usage.
import * as ortNode from 'onnxruntime-node';
import * as ortWeb from 'onnxruntime-web';
import { TrainingSession, VERSION, type FitResult, type Manifest } from 'onnxtrain';

async function node(): Promise<void> {
  const sess = await TrainingSession.load(ortNode, '/path/to/bundle');
  await sess.initialize();
  const X = new ortNode.Tensor('float32', new Float32Array(64), [1, 64]);
  const out = await sess.trainStep({ X }, { algorithm: 0 });
  const loss: ortNode.Tensor = out.loss;
  const pred = await sess.run({ X }, { outputs: ['logits'] });
  const w: ortNode.Tensor = sess.state.W1;
  sess.learningRate = sess.learningRate * 0.5;
  const bytes: Uint8Array = sess.stateBytes();
  const fitted: FitResult = await sess.fit({ X: { data: new Float32Array(64), shape: [1, 64] }, label: { data: [1] } }, {
    epochs: 2, batchSize: 1, onStep: (s) => console.log(s.loss), onEpoch: (e) => console.log(e.loss),
  });
  const m: Readonly<Manifest> = sess.manifest;
  await sess.save('/tmp/out', { overwrite: true });
  console.log(loss.dims, pred.logits, w.type, bytes.length, fitted.loss, m.version, VERSION, sess.fitPosition?.step);
}

async function web(): Promise<void> {
  const sess = await TrainingSession.load(ortWeb, 'bundle', { sessionOptions: { executionProviders: ['wasm'] } });
  const files = await sess.bundleFiles();
  const t: ortWeb.Tensor = (await sess.run({ X: new ortWeb.Tensor('float32', new Float32Array(4), [1, 4]) })).Y;
  const again = await TrainingSession.load(ortWeb, { ...files, 'state.bin': sess.stateBytes() });
  console.log(t.dims, again.numAlgorithms);
}

export { node, web };
