// Type declarations of the npm package `onnxtrain` (both entries: the Node
// entry adds folder paths to `load` and implements `save`).
//
// The package imports no onnxruntime package: these types describe the part
// of onnxruntime's JavaScript API it uses, so that onnxruntime-node,
// onnxruntime-web and onnxruntime-react-native modules all fit.

/** The package version. */
export declare const VERSION: string;
/** The bundle format versions this package reads. */
export declare const VERSIONS: readonly number[];
/** The manifest's `format` value: "onnxtrain-bundle". */
export declare const FORMAT: string;

/** An onnxruntime tensor, as the package reads it (ort.Tensor fits). */
export interface TensorLike {
  readonly type: string;
  readonly dims: readonly number[];
  readonly data: unknown;
}

/** The part of an onnxruntime module the package uses (`import * as ort from 'onnxruntime-node'`). */
export interface OrtModule<T extends TensorLike = TensorLike> {
  InferenceSession: {
    // eslint-disable-next-line @typescript-eslint/no-explicit-any
    create(model: any, options?: any): Promise<any>;
  };
  // eslint-disable-next-line @typescript-eslint/no-explicit-any
  Tensor: new (type: any, data: any, dims?: readonly number[]) => T;
}

/** A tensor dtype name of the bundle (numpy's names). */
export type DType =
  | 'float32' | 'float64' | 'float16' | 'int8' | 'uint8' | 'int16' | 'uint16'
  | 'int32' | 'uint32' | 'int64' | 'uint64' | 'bool';

/** A dimension: a size, a symbolic name, or null (unknown). */
export type Dim = number | string | null;

export interface FeedInfo {
  name: string;
  dtype: DType;
  /** null: any rank. */
  shape: Dim[] | null;
}

export interface StateEntry {
  name: string;
  dtype: DType;
  shape: number[];
  offset: number;
  length: number;
  trainable?: boolean;
}

export interface Binding {
  key: string;
  value: string;
}

export interface ProgramEntry {
  label?: string;
  file: string;
  feeds: FeedInfo[];
  optional_feeds: FeedInfo[];
  state_inputs: string[];
  outputs: string[];
}

export interface AlgorithmEntry extends ProgramEntry {
  returned: string[];
  bindings: Binding[];
}

export interface InitializationEntry {
  label?: string;
  file: string;
  outputs: string[];
  bindings: Binding[];
}

export interface FitPosition {
  epoch: number;
  batch: number;
  step: number;
}

/** manifest.json (docs/bundle.md). */
export interface Manifest {
  format: 'onnxtrain-bundle';
  version: number;
  producer?: { name: string; version: string };
  opset?: number;
  ir_version?: number;
  state_file: string;
  state_bytes: number;
  state: StateEntry[];
  constants_file: string | null;
  inference: ProgramEntry;
  algorithms: AlgorithmEntry[];
  initializations: (InitializationEntry | null)[];
  inference_model: string;
  training_model: string;
  training: {
    inputs?: string[] | null;
    target?: string | null;
    loss?: string | null;
    prediction?: string | null;
    task?: string | null;
    classes?: { count: number; axis: number } | null;
    metrics?: string[] | null;
    cycle?: (number | null)[] | null;
    learning_rate?: { state: string; base: number } | null;
  } | null;
  fit_position: FitPosition | null;
}

/** A file's content: bytes, or (manifest.json) its text or its object. */
export type FileContent = Uint8Array | ArrayBuffer | ArrayBufferView | string | Manifest;

/**
 * Where a bundle comes from: a base URL (absolute or relative to the page;
 * the trailing slash is optional), a folder path or file: URL (Node), or the
 * files already read, by name.
 */
export type BundleSource = string | URL | Record<string, FileContent>;

export interface LoadOptions {
  /** Passed to every `ort.InferenceSession.create` (execution providers, threads, ...). */
  sessionOptions?: Record<string, unknown>;
  /** Replaces the global fetch for URL sources. */
  fetch?: (url: string) => Promise<{ ok: boolean; status: number; statusText: string; arrayBuffer(): Promise<ArrayBuffer> }>;
}

export interface TrainStepOptions {
  /** Run training_info[algorithm] only; other algorithms' feeds are ignored. Default: every algorithm, in order. */
  algorithm?: number;
}

export interface RunOptions {
  /** The outputs to return (default: every output of the main graph). */
  outputs?: string[];
}

/** A column of fit's data: values with rows on axis 0. */
export interface Column {
  data: ArrayLike<number | bigint | boolean>;
  /** [rows, ...]; optional for a one-dimensional feed. */
  shape?: readonly number[];
}

export interface StepInfo {
  epoch: number;
  batch: number;
  /** Steps done in this fit call. */
  step: number;
  /** Rows in the batch. */
  size: number;
  stepsPerEpoch: number;
  /** The batch's mean loss, where the step returned the loss. */
  loss?: number;
}

export interface EpochInfo {
  epoch: number;
  /** The epoch's mean loss, weighted by rows (NaN when no step returned one). */
  loss: number;
  steps: number;
  seconds: number;
}

export interface FitOptions {
  /** The epoch to stop at (as Python's fit and Keras: a resumed fit trains epochs initialEpoch..epochs-1). */
  epochs?: number;
  batchSize?: number;
  shuffle?: boolean;
  seed?: number;
  /** Skip a last partial batch (default: true only for a fixed batch dimension). */
  dropLast?: boolean;
  /** The algorithm of each batch, repeated (null: every algorithm); default the bundle's training.cycle. */
  cycle?: (number | null)[];
  /** Default: the loaded bundle's fit position (a checkpoint resumes), else 0. */
  initialEpoch?: number;
  /** The output averaged as the loss (default: the bundle's training.loss, else 'loss'). */
  loss?: string;
  onStep?: (info: StepInfo) => void | Promise<void>;
  onEpoch?: (info: EpochInfo) => void | Promise<void>;
  /** Stops after the current step when aborted. */
  signal?: { readonly aborted: boolean };
}

export interface FitResult {
  /** The mean loss of each epoch. */
  loss: number[];
  /** The epoch index of each entry of `loss`. */
  epochs: number[];
  steps: number;
  stoppedEarly: boolean;
}

export interface SaveOptions {
  /** Replace an existing non-empty folder. */
  overwrite?: boolean;
}

export declare class TrainingSession<T extends TensorLike = TensorLike> {
  private constructor();
  /** Load a bundle (see BundleSource); refuses an unknown version or a missing file. */
  static load<T extends TensorLike>(ort: OrtModule<T>, source: BundleSource, options?: LoadOptions): Promise<TrainingSession<T>>;
  /** Run the initialization programs and apply their bindings, as Python's initialize(). */
  initialize(): Promise<void>;
  /** One atomic training step; returns the outputs no binding consumes. */
  trainStep(feeds: Record<string, T>, options?: TrainStepOptions): Promise<Record<string, T>>;
  /** The inference program on the current state. */
  run(feeds: Record<string, T>, options?: RunOptions): Promise<Record<string, T>>;
  /** Epochs over arrays in batches; returns the mean loss per epoch. */
  fit(data: Record<string, Column | T>, options?: FitOptions): Promise<FitResult>;
  /** A frozen snapshot of every state variable (copies). */
  readonly state: Readonly<Record<string, T>>;
  /** One state variable (a copy). */
  getState(name: string): T;
  /** Set state variables (dtype and shape must match); all or nothing. */
  setState(values: Record<string, T | ArrayBufferView>): Promise<void>;
  readonly stateNames: string[];
  readonly manifest: Readonly<Manifest>;
  readonly numAlgorithms: number;
  readonly ort: OrtModule<T>;
  /** The rate in manifest.training.learning_rate's state variable; throws where there is none. */
  learningRate: number;
  /** Where the fit loop stands; save() writes it. */
  fitPosition: FitPosition | null;
  /** 'bundle' (loaded; fit resumes from it), 'fit', or null. */
  readonly positionSource: 'bundle' | 'fit' | null;
  /** A state.bin of the current state, in the loaded manifest's layout. */
  stateBytes(): Uint8Array;
  /** manifest.json of a bundle of the current state. */
  manifestText(): string;
  /** Every file of a complete bundle of the current state. */
  bundleFiles(options?: { paths?: false }): Promise<Record<string, Uint8Array>>;
  /** Node, a folder source: files not held in memory come as { path } to copy. */
  bundleFiles(options: { paths: true }): Promise<Record<string, Uint8Array | { path: string }>>;
  /** Node: write a complete bundle, atomically; refuses a non-empty folder unless overwrite. */
  save(folder: string, options?: SaveOptions): Promise<string>;
  /** Release the onnxruntime sessions. */
  release(): Promise<void>;
}

/** The shuffle order of fit: a permutation of 0..n-1 from (seed, epoch). */
export declare function permutation(n: number, seed: number, epoch: number): Uint32Array;
