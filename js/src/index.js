// onnxtrain for browsers, react-native and any other platform with fetch:
// no node: import anywhere below.  Node's entry is node.js.

export { TrainingSession, VERSION } from './session.js';
export { VERSIONS, FORMAT } from './manifest.js';
export { permutation } from './fit.js';
