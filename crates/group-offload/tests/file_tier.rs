//! The file tier: a model bound to its checkpoint file streams from it. A toy model (an embedding, blocks of two
//! linear layers and a norm, a final norm and a head) is written to a safetensors file by each test, in bf16 and
//! in f32; bound to it and streamed at block and leaf level on a hard simulated card, its output equals the same
//! model loaded the usual way (burn-store), bit for bit, while the store holds none of its bytes in host memory
//! and no parameter of the bound model is ever read into it. Bad checkpoints are typed errors.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::quantization::{QuantScheme, QuantStore, QuantValue};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use group_offload::prelude::*;
use group_offload::weights::{BindOptions, FileTable, TensorPlace, TensorTransform, WeightIndex, bind};
use group_offload::whole::{module_bytes_with, module_tensor_sizes};
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::{Action, ComponentError, ComponentsManager, DeviceMemory};

#[derive(Module, Debug)]
struct Block {
    fc1: Linear,
    fc2: Linear,
    norm: LayerNorm,
}

#[derive(Module, Debug, OffloadModel)]
struct Toy {
    embed: Embedding,
    #[offload(blocks)]
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Linear,
}

/// A model that declares no parts: it moves whole.
#[derive(Module, Debug, OffloadModel)]
struct Head {
    fc: Linear,
    norm: LayerNorm,
}

const VOCAB: usize = 32;
const WIDTH: usize = 24;
const HIDDEN: usize = 40;
const BLOCKS: usize = 4;

impl ToyWeights<'_> {
    /// The one forward; `fc2_at` is where it takes the second projection from (`"fc2"` when right; `"fc1"` reads
    /// fc2 through fc1's part, a stray load at leaf level).
    fn forward(self, ids: Tensor<2, Int>, fc2_at: &str) -> Result<Tensor<3>> {
        let x = self.shell.get()?.embed.forward(ids);
        let x = self.blocks.fold(x, |block, x| {
            let h = leaf!(block, fc1).forward(x.clone());
            let h = block.part(fc2_at)?.fc2.forward(burn::tensor::activation::gelu(h));
            Ok(block.own()?.norm.forward(x + h))
        })?;
        let shell = self.shell.get()?;
        Ok(shell.head.forward(shell.norm.forward(x)))
    }
}

/// A freshly built toy: every parameter lazy, nothing allocated.
fn toy(device: &Device) -> Toy {
    let block = || Block {
        fc1: LinearConfig::new(WIDTH, HIDDEN).init(device),
        fc2: LinearConfig::new(HIDDEN, WIDTH).init(device),
        norm: LayerNormConfig::new(WIDTH).init(device),
    };
    Toy {
        embed: EmbeddingConfig::new(VOCAB, WIDTH).init(device),
        blocks: (0..BLOCKS).map(|_| block()).collect(),
        norm: LayerNormConfig::new(WIDTH).init(device),
        head: LinearConfig::new(WIDTH, 8).init(device),
    }
}

fn ids(device: &Device) -> Tensor<2, Int> {
    Tensor::from_data(TensorData::new((0..12).map(|i| (i * 7 % VOCAB) as i64).collect(), [2, 6]), device)
}

/// Every float parameter of `module`, by path, in `dtype`: what a checkpoint holds.
fn tensors_of<M: Module>(module: &M, dtype: DType) -> Vec<(String, TensorData)> {
    struct Collect {
        stack: Vec<String>,
        out: Vec<(String, TensorData)>,
        dtype: DType,
    }
    impl ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.out.push((self.stack.join("."), param.val().cast(self.dtype).into_data()));
        }
    }
    let mut collect = Collect { stack: Vec::new(), out: Vec::new(), dtype };
    module.visit(&mut collect);
    collect.out
}

/// Writes `tensors` as a safetensors file at `path`.
fn write_file(path: &Path, tensors: &[(String, TensorData)]) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, data)| {
            let dtype = match data.dtype() {
                DType::F32 => safetensors::Dtype::F32,
                DType::BF16 => safetensors::Dtype::BF16,
                DType::I32 => safetensors::Dtype::I32,
                other => panic!("the test writes no {other:?}"),
            };
            let view = safetensors::tensor::TensorView::new(dtype, data.shape().to_vec(), data.as_bytes())
                .expect("a valid view");
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("the checkpoint is written");
}

/// A checkpoint of a random toy in `dtype`, in a new temporary directory.
fn checkpoint(dtype: DType) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("toy.safetensors");
    write_file(&path, &tensors_of(&toy(&Device::flex()), dtype));
    (dir, path)
}

/// The toy loaded the usual way: burn-store reads every tensor into memory.
fn loaded(path: &Path) -> Toy {
    let mut model = toy(&Device::flex());
    let result = model.load_from(&mut SafetensorsStore::from_file(path)).expect("it loads");
    assert!(result.errors.is_empty() && result.missing.is_empty() && result.unused.is_empty(), "{result:?}");
    model
}

fn bound(path: &Path) -> (Toy, FileTable) {
    let index = WeightIndex::open(&[path.to_path_buf()], str::to_string).expect("the index opens");
    let (model, table, report) = bind(toy(&Device::flex()), &index, &BindOptions::new()).expect("it binds");
    assert!(report.is_complete(), "{report:?}");
    (model, table)
}

/// The bits of a tensor's values.
fn bits(tensor: Tensor<3>) -> Vec<u8> {
    tensor.into_data().as_bytes().to_vec()
}

/// How many float parameters of `module` were read into memory.
fn initialised<M: Module>(module: &M) -> usize {
    struct Count(usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 += usize::from(param.is_initialized());
        }
    }
    let mut count = Count(0);
    module.visit(&mut count);
    count.0
}

fn card() -> Arc<SimCard> {
    SimCard::new(CardSpec::parse("64MiB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0))
}

fn levels() -> [GroupOptions; 3] {
    [
        GroupOptions::default(),
        GroupOptions { level: GroupLevel::Block { blocks_per_group: 2 }, ..GroupOptions::default() },
        GroupOptions::leaf(),
    ]
}

#[test]
fn a_bound_model_streams_from_its_file_bit_for_bit_and_reads_nothing_into_memory() {
    let device = Device::flex();
    for dtype in [DType::BF16, DType::F32] {
        let (_dir, path) = checkpoint(dtype);
        let reference = loaded(&path);
        let want = bits(whole(reference.weights().forward(ids(&device), "fc2")));
        for options in levels() {
            let (model, table) = bound(&path);
            let probe = model.clone();
            let card = card();
            let manager = Arc::new(ComponentsManager::new());
            let mut handle = ModelHandle::register_files(
                &manager,
                "toy",
                model,
                table.clone(),
                OffloadDevice::simulated(card.clone()),
            )
            .expect("it registers");
            // Moved whole from its file until it streams: one group, onloaded by the manager.
            let whole_out = handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect("whole run");
            assert_eq!(bits(whole_out), want, "{dtype:?}: the whole component differs from the loaded model");
            handle.enable_group_offload(&options).expect("it streams");
            for pass in 0..3 {
                let out = handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect("a forward");
                assert_eq!(bits(out), want, "{dtype:?} {:?} pass {pass}: differs from the loaded model", options.level);
            }
            let offload = handle.group_offload().expect("grouped").clone();
            offload.wait_idle();
            let stats = offload.stats();
            assert_eq!((stats.stray_loads, stats.misses), (0, 0), "{dtype:?} {:?}: {stats:?}", options.level);
            assert!(stats.prefetch_hits + stats.prefetch_waits > 0, "nothing was prefetched: {stats:?}");
            // The store holds none of the model in host memory, and nothing read a bound parameter into it.
            assert_eq!(offload.host_memory_bytes(), 0, "{dtype:?} {:?}", options.level);
            assert_eq!(offload.file_bytes(), std::fs::metadata(&path).expect("a file").len() - header_len(&path));
            assert_eq!(initialised(&probe), 0, "a bound parameter was read into memory");
            assert_eq!(table.materialised().0, 0, "{:?}", table.materialised());
            // Every upload read its group from the file, and the disk meter counted each read (the prefetch the
            // last forward's end made included: waited for, so that it is in both or in neither).
            offload.wait_idle();
            let uploads: Vec<_> = manager
                .offload_record()
                .events()
                .into_iter()
                .filter(|e| e.action == Action::Onload && e.is_group_move())
                .collect();
            assert!(!uploads.is_empty());
            assert!(uploads.iter().all(|e| e.read.is_some_and(|read| read.bytes == e.bytes)), "{uploads:?}");
            let totals = offload.disk_totals();
            assert_eq!(totals.reads, uploads.len() as u64);
            assert_eq!(totals.bytes, uploads.iter().map(|e| e.bytes).sum::<u64>());
            assert!(handle.disk_rate().is_some_and(|rate| rate.median > 0.0));
            assert!(card.peak() > 0 && card.peak() < card.total());
        }
    }
}

/// The length of a safetensors file's header, its 8-byte prefix included.
fn header_len(path: &Path) -> u64 {
    let bytes = std::fs::read(path).expect("the file");
    8 + u64::from_le_bytes(bytes[..8].try_into().expect("eight bytes"))
}

#[test]
fn the_sizes_and_layout_of_a_bound_model_come_from_its_table_without_reading_it() {
    let device = Device::flex();
    for dtype in [DType::BF16, DType::F32] {
        let (_dir, path) = checkpoint(dtype);
        let reference = loaded(&path);
        let (model, table) = bound(&path);
        let probe = model.clone();
        // Sized from the table: the loaded model's sizes, tensor by tensor, with nothing read.
        let sizes = group_offload::whole::module_tensor_sizes_with(&model, Some(&device), Some(&table));
        assert_eq!(sizes, module_tensor_sizes(&reference));
        assert_eq!(module_bytes_with(&model, None, Some(&table)), table.bytes());
        let layout = group_offload::model::measure_layout_with(&model, Some(&device), &table);
        assert_eq!(layout, group_offload::model::measure_layout_on(&reference, &device));
        let manager = Arc::new(ComponentsManager::new());
        let handle = ModelHandle::register_files(&manager, "toy", model, table.clone(), OffloadDevice::host_only())
            .expect("it registers");
        assert_eq!(handle.layout().expect("measured"), layout);
        assert!(!handle.is_quantized());
        let spec = group_offload::apply::component_spec(&manager, &handle).expect("a spec");
        assert_eq!(spec.weight_bytes, group_offload::module_bytes(&reference));
        assert_eq!(initialised(&probe), 0, "measuring a bound model read it");
        assert_eq!(table.materialised().0, 0);
    }
}

#[test]
fn a_weight_touched_outside_its_group_reads_the_right_bytes_and_is_counted() {
    let device = Device::flex();
    let (_dir, path) = checkpoint(DType::BF16);
    let reference = loaded(&path);
    // On the bound model itself: the parameter's initialiser reads its file tensor, counted in the table.
    let (model, table) = bound(&path);
    let head = model.head.weight.val().into_data();
    assert_eq!(head, reference.head.weight.val().into_data());
    assert_eq!(table.materialised(), (1, vec!["head.weight".to_string()]));
    // Under leaf-level streaming, fc2 read through fc1's part is a stray load of the file's bytes.
    let want = bits(whole(reference.weights().forward(ids(&device), "fc2")));
    let (model, table) = bound(&path);
    let manager = Arc::new(ComponentsManager::new());
    let mut handle =
        ModelHandle::register_files(&manager, "toy", model, table, OffloadDevice::host_only()).expect("it registers");
    handle.enable_group_offload(&GroupOptions::leaf()).expect("it streams");
    let out = handle.run(0, |weights, _| weights.forward(ids(&device), "fc1")).expect("a forward");
    assert_eq!(bits(out), want, "a stray load read other bytes than the file's");
    let offload = handle.group_offload().expect("grouped");
    // fc2's weight and bias, in every block.
    assert_eq!(offload.stats().stray_loads, 2 * BLOCKS as u64);
    assert!(offload.stray_parameters().iter().all(|p| p.contains("fc2")), "{:?}", offload.stray_parameters());
}

/// Writes the toy's checkpoint less the tensors `drop` names, plus `extra`.
fn edited(dtype: DType, drop: &[&str], extra: &[(&str, TensorData)]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("toy.safetensors");
    let mut tensors = tensors_of(&toy(&Device::flex()), dtype);
    tensors.retain(|(name, _)| !drop.contains(&name.as_str()));
    tensors.extend(extra.iter().map(|(name, data)| (name.to_string(), data.clone())));
    write_file(&path, &tensors);
    (dir, path)
}

fn bind_path(
    path: &Path,
    options: &BindOptions,
) -> group_offload::Result<(Toy, FileTable, group_offload::weights::BindReport)> {
    let index = WeightIndex::open(&[path.to_path_buf()], str::to_string)?;
    bind(toy(&Device::flex()), &index, options)
}

#[test]
fn a_missing_unused_or_mismatched_tensor_is_a_typed_error_or_a_report() {
    let extra = TensorData::new(vec![0f32; 4], [4]);
    let (_dir, path) = edited(DType::F32, &["blocks.1.fc2.bias"], &[("lm_head.weight", extra)]);
    match bind_path(&path, &BindOptions::new()) {
        Err(Error::PartialBind { missing, unused }) => {
            assert_eq!((missing, unused), (vec!["blocks.1.fc2.bias".to_string()], vec!["lm_head.weight".to_string()]));
        }
        other => panic!("expected a partial binding, got {other:?}"),
    }
    let message = bind_path(&path, &BindOptions::new()).expect_err("refused").to_string();
    assert_eq!(
        message,
        "binding to the checkpoint left 1 parameter(s) missing (first: blocks.1.fc2.bias) and 1 file tensor(s) unused \
         (first: lm_head.weight); the checkpoint does not match the model, or it needs key renames: allow a partial \
         binding only if that is intended"
    );
    let (_, table, report) = bind_path(&path, &BindOptions::new().with_allow_partial(true)).expect("allowed");
    assert_eq!((report.missing.len(), report.unused.len(), report.applied.len()), (1, 1, table.len()));

    let wrong = TensorData::new(vec![0f32; 8 * 3], [8, 3]);
    let (_dir, path) = edited(DType::F32, &["head.weight"], &[("head.weight", wrong)]);
    let error = bind_path(&path, &BindOptions::new()).expect_err("refused");
    assert!(matches!(&error, Error::WeightShape { tensor, .. } if tensor == "head.weight"), "{error:?}");
    assert_eq!(
        error.to_string(),
        format!(
            "cannot bind head.weight from {}: it has shape [8, 3], the model's parameter [24, 8]; the checkpoint does \
             not match the model's config",
            path.display()
        )
    );
    let ints = TensorData::new(vec![0i32; WIDTH * 8], [WIDTH, 8]);
    let (_dir, path) = edited(DType::F32, &["head.weight"], &[("head.weight", ints)]);
    let error = bind_path(&path, &BindOptions::new()).expect_err("refused");
    assert!(matches!(&error, Error::WeightDType { found, .. } if found == "I32"), "{error:?}");
    assert_eq!(
        error.to_string(),
        format!(
            "cannot bind head.weight from {}: it is stored as I32, which a float parameter cannot hold; the \
             checkpoint does not match the model",
            path.display()
        )
    );
}

#[test]
fn a_damaged_checkpoint_is_refused_when_it_opens() {
    let (dir, path) = checkpoint(DType::F32);
    let len = std::fs::metadata(&path).expect("a file").len();
    let open = |path: &Path| WeightIndex::open(&[path.to_path_buf()], str::to_string).map(|_| ());
    let copy = |name: &str, bytes: &[u8]| {
        let copy = dir.path().join(name);
        std::fs::write(&copy, bytes).expect("written");
        copy
    };
    let full = std::fs::read(&path).expect("read");
    let cases: Vec<(PathBuf, String)> = vec![
        (
            copy("short.safetensors", &full[..(len - 10) as usize]),
            format!("holds {} after the header: it is truncated", len - header_len(&path) - 10),
        ),
        (
            copy("long.safetensors", &[full.as_slice(), &[0u8; 3]].concat()),
            "it holds 3 bytes past its last tensor".into(),
        ),
        (copy("tiny.safetensors", &full[..5]), "it holds 5 bytes, fewer than a safetensors header's length".into()),
        (
            copy("huge.safetensors", &[&200_000_000u64.to_le_bytes()[..], b"{}"].concat()),
            "its header claims 200000000 bytes, past safetensors' limit of 100000000".into(),
        ),
        (
            copy("text.safetensors", &[&4u64.to_le_bytes()[..], b"{{{{"].concat()),
            "its header does not parse as safetensors".into(),
        ),
        (dir.path().join("absent.safetensors"), "it cannot be opened".into()),
    ];
    for (file, words) in cases {
        let error = open(&file).expect_err("refused");
        assert!(matches!(error, Error::WeightFile { .. }), "{error:?}");
        let message = error.to_string();
        println!("{message}");
        assert!(message.contains(&words), "{}: {message}", file.display());
        assert!(message.ends_with("re-download it, or check that the path names the component's weights"), "{message}");
    }
    // Two tensors renamed to one name.
    let error =
        WeightIndex::open(std::slice::from_ref(&path), |name: &str| name.replace("fc1", "fc2")).expect_err("refused");
    println!("{error}");
    assert!(
        error.to_string().contains("after the key renames")
            && error.to_string().ends_with("fix the renames, or the shard list if a shard is given twice"),
        "{error}"
    );
}

#[test]
fn a_file_truncated_under_a_running_model_is_a_typed_error_when_a_group_reads_it() {
    let device = Device::flex();
    let (_dir, path) = checkpoint(DType::BF16);
    let (model, table) = bound(&path);
    let manager = Arc::new(ComponentsManager::new());
    let card = card();
    let mut handle = ModelHandle::register_files(&manager, "toy", model, table, OffloadDevice::simulated(card.clone()))
        .expect("it registers");
    handle.enable_group_offload(&GroupOptions::default()).expect("it streams");
    handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect("a forward");
    let offload = handle.group_offload().expect("grouped").clone();
    offload.wait_idle();
    // Cut the file in the middle of its blocks: the groups past the cut can no longer be read.
    let len = std::fs::metadata(&path).expect("a file").len();
    std::fs::OpenOptions::new().write(true).open(&path).expect("opened").set_len(len / 2).expect("truncated");
    let error = handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect_err("a typed error");
    let inner = match &error {
        Error::Manager(offload_core::Error::Component { source: ComponentError::Other(inner), .. }) => {
            inner.downcast_ref::<Error>()
        }
        _ => None,
    };
    assert!(matches!(inner, Some(Error::FileRead { .. })), "{error:#?}");
    let message = error.to_string();
    println!("{message}");
    assert!(message.contains("failed to fill whole buffer"), "{message}");
    assert!(
        message.contains("the checkpoint file changed or was truncated after it was opened: restore it"),
        "{message}"
    );
    // Nothing stays reserved for the group that could not be read.
    offload.wait_idle();
    let resident: u64 = offload.on_device().len() as u64;
    assert!(card.allocated() <= resident * offload.largest_group() + offload.resident_bytes(), "{}", card.allocated());
}

/// Quantizes every linear weight with burn's Q8S, as the loaded reference is quantized below.
struct Q8Linears;

impl TensorTransform for Q8Linears {
    fn target(&self, place: &TensorPlace<'_>) -> Option<DType> {
        (place.module == "Struct:Linear" && place.path.ends_with(".weight")).then(|| DType::QFloat(scheme()))
    }

    fn apply(&self, _place: &TensorPlace<'_>, data: TensorData) -> std::result::Result<TensorData, String> {
        let dtype = data.dtype();
        let tensor = Tensor::<2>::from_data(data, (&Device::flex(), dtype));
        Ok(tensor.quantize_dynamic(&scheme()).into_data())
    }
}

fn scheme() -> QuantScheme {
    QuantScheme::default().with_value(QuantValue::Q8S).with_store(QuantStore::Native)
}

/// The loaded reference with the same weights quantized in memory, the usual way.
fn quantized(model: Toy) -> Toy {
    struct Quantize(Vec<String>);
    impl ModuleMapper for Quantize {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.0.push(format!("{name}:{container}"));
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if D == 2 && self.0.last().is_some_and(|last| last == "weight:Struct:Linear") {
                param.map(|w| w.quantize_dynamic(&scheme()))
            } else {
                param
            }
        }
    }
    model.map(&mut Quantize(Vec::new()))
}

#[test]
fn a_transform_quantizes_tensor_by_tensor_as_groups_are_taken_apart() {
    let device = Device::flex();
    let (_dir, path) = checkpoint(DType::F32);
    let reference = quantized(loaded(&path));
    let want = bits(whole(reference.weights().forward(ids(&device), "fc2")));
    let index = WeightIndex::open(std::slice::from_ref(&path), str::to_string).expect("the index opens");
    let options = BindOptions::new().with_transform(Arc::new(Q8Linears));
    let (model, table, _) = bind(toy(&device), &index, &options).expect("it binds");
    // The sizes are the quantized ones before anything is read.
    let sizes = group_offload::whole::module_tensor_sizes_with(&model, Some(&device), Some(&table));
    assert_eq!(sizes, module_tensor_sizes(&reference));
    let manager = Arc::new(ComponentsManager::new());
    let mut handle = ModelHandle::register_files(&manager, "toy", model, table.clone(), OffloadDevice::host_only())
        .expect("it registers");
    assert!(handle.is_quantized());
    handle.enable_group_offload(&GroupOptions::default()).expect("it streams");
    for _ in 0..2 {
        let out = handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect("a forward");
        assert_eq!(bits(out), want, "differs from the model quantized in memory");
    }
    // The quantized weights are held in memory; the rest is read from the file.
    let offload = handle.group_offload().expect("grouped");
    let quantized_bytes: u64 = table_sizes(&reference, true).iter().sum();
    assert_eq!(offload.host_memory_bytes(), quantized_bytes);
    assert_eq!(offload.total_bytes(), group_offload::module_bytes(&reference));
    assert_eq!(table.materialised().0, 0);
}

/// The sizes of the quantized (`true`) or float (`false`) parameters of `model`.
fn table_sizes<M: Module>(model: &M, quantized: bool) -> Vec<u64> {
    struct Sizes(Vec<u64>, bool);
    impl ModuleVisitor for Sizes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let tensor = param.val();
            if matches!(tensor.dtype(), DType::QFloat(_)) == self.1 {
                self.0.push(group_offload::whole::tensor_bytes(&tensor));
            }
        }
    }
    let mut sizes = Sizes(Vec::new(), quantized);
    model.visit(&mut sizes);
    sizes.0
}

#[test]
fn a_bound_model_streams_from_the_disk_store_written_tensor_by_tensor_from_its_file() {
    let device = Device::flex();
    let (dir, path) = checkpoint(DType::BF16);
    let want = bits(whole(loaded(&path).weights().forward(ids(&device), "fc2")));
    let (model, table) = bound(&path);
    let manager = Arc::new(ComponentsManager::new());
    let mut handle =
        ModelHandle::register_files(&manager, "toy", model, table, OffloadDevice::host_only()).expect("it registers");
    let store = dir.path().join("store");
    handle
        .enable_group_offload(&GroupOptions { disk_store: Some(store.clone()), ..GroupOptions::default() })
        .expect("it streams");
    let out = handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect("a forward");
    assert_eq!(bits(out), want);
    let offload = handle.group_offload().expect("grouped");
    assert_eq!(offload.host_memory_bytes(), 0);
    assert_eq!(offload.disk_files().len(), BLOCKS + 1);
    assert!(offload.host_checksums().iter().all(|(_, sum)| sum.is_ok()), "{:?}", offload.host_checksums());
    // Every group file parses as safetensors and holds its group's bytes.
    for file in offload.disk_files() {
        let bytes = std::fs::read(&file).expect("a group file");
        safetensors::SafeTensors::deserialize(&bytes).expect("it parses");
    }
    // The disk store's reads are timed too.
    assert!(offload.disk_totals().reads > 0);
}

#[test]
fn a_model_with_no_parts_moves_whole_from_its_file() {
    let device = Device::flex();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("head.safetensors");
    let head = || Head { fc: LinearConfig::new(WIDTH, 8).init(&device), norm: LayerNormConfig::new(8).init(&device) };
    write_file(&path, &tensors_of(&head(), DType::BF16));
    let mut reference = head();
    reference.load_from(&mut SafetensorsStore::from_file(&path)).expect("it loads");
    let x = Tensor::<2>::ones([2, WIDTH], (&device, DType::BF16));
    let want = reference.norm.forward(reference.fc.forward(x.clone())).into_data();

    let index = WeightIndex::open(std::slice::from_ref(&path), str::to_string).expect("the index opens");
    let (model, table, _) = bind(head(), &index, &BindOptions::new()).expect("it binds");
    let card = card();
    let manager = Arc::new(ComponentsManager::new());
    let mut handle =
        ModelHandle::register_files(&manager, "head", model, table, OffloadDevice::simulated(card.clone()))
            .expect("it registers");
    manager.enable_auto_offload(card.clone(), 0, true).expect("auto offload");
    let out = handle.run(0, |head, _| Ok(head.norm.forward(head.fc.forward(x.clone())))).expect("a run");
    assert_eq!(out.into_data(), want);
    assert!(card.allocated() > 0, "the whole group stays on the device after its run");
    // It cannot stream by blocks (it declares none), and nothing is lost by asking.
    let error = handle.enable_group_offload(&GroupOptions::default()).expect_err("no parts");
    assert!(matches!(error, Error::RouteUnsupported { .. }), "{error:?}");
    let out = handle.run(0, |head, _| Ok(head.norm.forward(head.fc.forward(x.clone())))).expect("a run");
    assert_eq!(out.into_data(), want);
    // The manager releases it whole, as any releasable component.
    manager.disable_auto_offload().expect("offloaded");
    assert_eq!(card.allocated(), 0);
}

#[test]
fn every_group_read_is_a_file_read_span_on_the_thread_that_uploads_it() {
    let device = Device::flex();
    let (_dir, path) = checkpoint(DType::BF16);
    let (model, table) = bound(&path);
    let manager = Arc::new(ComponentsManager::new());
    let timeline = offload_core::Timeline::enabled();
    manager.set_timeline(timeline.clone());
    let mut handle =
        ModelHandle::register_files(&manager, "toy", model, table, OffloadDevice::host_only()).expect("it registers");
    handle.enable_group_offload(&GroupOptions::default()).expect("it streams");
    let offload = handle.group_offload().expect("grouped").clone();
    let before = offload.host_checksums();
    for _ in 0..2 {
        handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect("a forward");
    }
    offload.wait_idle();
    // Checksums read the file groups tensor by tensor, and nothing changed them.
    assert!(before.iter().all(|(_, sum)| sum.is_ok()), "{before:?}");
    assert_eq!(offload.host_checksums(), before);
    let events = timeline.events();
    let reads: Vec<_> = events.iter().filter(|e| e.category == "file_read").collect();
    assert_eq!(reads.len() as u64, offload.disk_totals().reads);
    for read in &reads {
        let upload = events.iter().find(|u| {
            u.category == "upload" && u.name == read.name && u.thread == read.thread && u.start_ns <= read.start_ns
        });
        assert!(upload.is_some(), "{read:?} is inside no upload of its group on its thread");
    }
    let threads = timeline.threads();
    let worker = |tid: u64| threads.iter().any(|t| t.tid == tid && t.name.starts_with("group-offload-"));
    assert!(reads.iter().any(|r| worker(r.thread)), "no prefetch read on the worker: {threads:?}");
}

#[test]
fn a_bound_model_rewritten_in_place_is_split_again_and_holds_only_what_was_written() {
    let device = Device::flex();
    let (_dir, path) = checkpoint(DType::F32);
    let reference = loaded(&path);
    let x = ids(&device);
    let (model, table) = bound(&path);
    let manager = Arc::new(ComponentsManager::new());
    let mut handle = ModelHandle::register_files(&manager, "toy", model, table.clone(), OffloadDevice::host_only())
        .expect("it registers");
    handle.enable_group_offload(&GroupOptions::default()).expect("it streams");
    let old_id = handle.id().to_string();
    // A rewrite that doubles the head's weight (as a fused LoRA rewrites a layer): read from the file, then held
    // in memory as an initialised parameter, while every other weight stays in the file.
    handle
        .rebuild(|mut model| {
            model.head.weight = model.head.weight.map(|w| w * 2.0);
            (model, ())
        })
        .expect("rewritten");
    assert_ne!(handle.id(), old_id, "re-registered");
    let mut doubled = reference;
    doubled.head.weight = doubled.head.weight.map(|w| w * 2.0);
    let want = bits(whole(doubled.weights().forward(x.clone(), "fc2")));
    let out = handle.run(0, |weights, _| weights.forward(x.clone(), "fc2")).expect("a forward");
    assert_eq!(bits(out), want);
    let offload = handle.group_offload().expect("still streamed at the same level");
    assert_eq!(offload.groups().len(), BLOCKS + 1);
    assert_eq!(offload.host_memory_bytes(), (WIDTH * 8 * 4) as u64, "only the rewritten weight is in memory");
    assert_eq!(table.materialised(), (1, vec!["head.weight".to_string()]));
}

/// The bytes of one toy block in `dtype`: fc1 and fc2 with their biases, and the norm's gamma and beta.
fn block_bytes(dtype: DType) -> u64 {
    ((WIDTH * HIDDEN + HIDDEN + HIDDEN * WIDTH + WIDTH + 2 * WIDTH) * dtype.size()) as u64
}

#[test]
fn a_ram_budget_keeps_the_reads_of_the_streamed_groups_that_fit_and_the_rest_read_the_file() {
    let device = Device::flex();
    let (_dir, path) = checkpoint(DType::BF16);
    let want = bits(whole(loaded(&path).weights().forward(ids(&device), "fc2")));
    let block = block_bytes(DType::BF16);
    // Room for two of the four blocks' reads: the first two uploaded keep theirs, the other two read the file
    // at every upload. The first block stays resident (a resident budget of one block): its read goes back.
    let options = GroupOptions {
        resident_budget: block,
        ram_budget: 2 * block + block / 2,
        prefetch: false,
        ..GroupOptions::default()
    };
    let (model, table) = bound(&path);
    let manager = Arc::new(ComponentsManager::new());
    let mut handle = ModelHandle::register_files(&manager, "toy", model, table, OffloadDevice::simulated(card()))
        .expect("registers");
    handle.enable_group_offload(&options).expect("it streams");
    let reads = |offload: &group_offload::parts::GroupOffload| offload.disk_totals().reads;
    let out = handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect("the first forward");
    assert_eq!(bits(out), want, "the first forward differs from the loaded model");
    let offload = handle.group_offload().expect("grouped").clone();
    let (kept, groups) = offload.kept_read_bytes();
    assert_eq!((kept, groups), (2 * block, 2), "blocks 1 and 2 keep their reads; block 0 stays resident");
    // From now on a forward reads only the block whose read did not fit: blocks 1 and 2 copy from host memory.
    for pass in 0..2 {
        let before = reads(&offload);
        let out = handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect("a forward");
        assert_eq!(bits(out), want, "pass {pass}: differs from the loaded model");
        assert_eq!(reads(&offload) - before, 1, "pass {pass}: only block 3 reads its file");
    }
    // The kept reads are the offloader's host memory now.
    assert_eq!(offload.kept_read_bytes(), (2 * block, 2));
    assert_eq!(offload.host_memory_bytes(), 2 * block);
    let uploads: Vec<_> = manager
        .offload_record()
        .events()
        .into_iter()
        .filter(|e| e.action == Action::Onload && e.is_group_move() && e.id == "toy/blocks_3_3")
        .collect();
    assert_eq!(uploads.len(), 3, "one upload a forward: {uploads:?}");
    assert!(uploads.iter().all(|e| e.read.is_some()), "block 3 reads its file at every upload: {uploads:?}");
}

/// Given the sizes a plan placed in RAM (`GroupOptions::ram_groups`), the RAM budget keeps only the reads of groups
/// of those sizes, one each, whatever room the budget has: two slots of a block's size keep two blocks' reads, and
/// a size no block has keeps none.
#[test]
fn with_the_plans_sizes_the_ram_budget_keeps_only_reads_of_those_sizes() {
    let device = Device::flex();
    let (_dir, path) = checkpoint(DType::BF16);
    let want = bits(whole(loaded(&path).weights().forward(ids(&device), "fc2")));
    let block = block_bytes(DType::BF16);
    let kept = |sizes: Vec<u64>| {
        let (model, table) = bound(&path);
        let manager = Arc::new(ComponentsManager::new());
        let mut handle = ModelHandle::register_files(&manager, "toy", model, table, OffloadDevice::simulated(card()))
            .expect("registers");
        let options = GroupOptions {
            ram_budget: BLOCKS as u64 * block,
            ram_groups: sizes,
            prefetch: false,
            ..GroupOptions::default()
        };
        handle.enable_group_offload(&options).expect("it streams");
        let out = handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect("a forward");
        assert_eq!(bits(out), want);
        handle.group_offload().expect("grouped").kept_read_bytes()
    };
    assert_eq!(kept(Vec::new()), (BLOCKS as u64 * block, BLOCKS), "no sizes: the budget alone");
    assert_eq!(kept(vec![block, block]), (2 * block, 2));
    assert_eq!(kept(vec![block + 2]), (0, 0));
}

#[test]
fn a_group_held_on_a_donor_gives_its_kept_read_back_to_the_ram_budget() {
    let device = Device::flex();
    let (_dir, path) = checkpoint(DType::BF16);
    let want = bits(whole(loaded(&path).weights().forward(ids(&device), "fc2")));
    let block = block_bytes(DType::BF16);
    let (model, table) = bound(&path);
    let manager = Arc::new(ComponentsManager::new());
    let mut handle = ModelHandle::register_files(&manager, "toy", model, table, OffloadDevice::simulated(card()))
        .expect("registers");
    let spec = (CardSpec::parse("64MiB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0))
        .with_device(offload_core::DeviceName::parse("cuda:1").expect("a name"));
    let donor = group_offload::config::PeerDonor::new(OffloadDevice::simulated(SimCard::new(spec)), block, 1e9);
    handle.add_donor(donor).expect("a donor before it streams");
    // RAM for every block's read, and a donor for one block: the first block uploaded goes to the donor and
    // gives its read back; the other three keep theirs.
    let options = GroupOptions { ram_budget: BLOCKS as u64 * block, prefetch: false, ..GroupOptions::default() };
    handle.enable_group_offload(&options).expect("it streams");
    for pass in 0..2 {
        let out = handle.run(0, |weights, _| weights.forward(ids(&device), "fc2")).expect("a forward");
        assert_eq!(bits(out), want, "pass {pass}");
    }
    let offload = handle.group_offload().expect("grouped");
    assert_eq!(offload.donor_bytes(), (block, 1));
    assert_eq!(offload.kept_read_bytes(), (3 * block, 3), "no group is held twice");
}
