//! The file tier on the tiny checkpoint: the text encoder, the transformer and the VAE bound to their checkpoint
//! files through `loading::Checkpoint::bind_*` give the usual load's report with nothing read; the text encoder
//! and the transformer registered from their files (`ModelHandle::register_files`) and streamed at block level
//! on a hard simulated card give the RAM path's image bit for bit, holding none of their weights in host memory.

use std::collections::BTreeSet;
use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use group_offload::{GroupOptions, ModelHandle, OffloadDevice};
use memory_sim::{CardSpec, Mode, SimCard};
use pipeline_zimage::loading::{BoundComponent, Checkpoint, LoadOptions, LoadReport, QuantizeLinearWeights};
use pipeline_zimage::pipeline::ZImagePipeline;
use pipeline_zimage::quantize::{int8_scheme, quantize_linear_weights};
use pipeline_zimage::text_encoder::TextEncoder;
use pipeline_zimage::vae::AutoencoderKl;

mod common;

use common::{fixtures, load_tiny, turbo_options, values};

fn checkpoint() -> Checkpoint {
    Checkpoint::open(fixtures().join("tiny-z-image-turbo")).expect("the tiny checkpoint opens")
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

/// The report with its applied list as a set: a load applies shard by shard, a binding in the model's order.
fn same_report(bound: &LoadReport, loaded: &LoadReport) {
    let set = |r: &LoadReport| r.applied.iter().cloned().collect::<BTreeSet<_>>();
    assert_eq!(set(bound), set(loaded));
    assert_eq!(bound.applied.len(), loaded.applied.len());
    let rest = |r: &LoadReport| {
        (
            r.component.clone(),
            r.files.clone(),
            r.missing.clone(),
            r.unused.clone(),
            r.ignored.clone(),
            r.skipped.clone(),
        )
    };
    assert_eq!(rest(bound), rest(loaded));
}

#[test]
fn binding_gives_the_usual_loads_report_and_reads_no_weight() {
    let device = Device::flex();
    let checkpoint = checkpoint();
    let opts = LoadOptions::new();

    let bound = checkpoint.bind_transformer(&device, &opts, None).expect("the transformer binds");
    let (_, loaded) = checkpoint.load_transformer(&device, &opts).expect("it loads");
    same_report(&bound.report, &loaded);
    assert_eq!(initialised(&bound.model), 0);
    assert_eq!(bound.files.len(), bound.report.applied.len());

    let (_, text_encoder) = checkpoint.bind_text_encoder(&device, &opts, None).expect("the text encoder binds");
    let (_, _, loaded) =
        TextEncoder::load(checkpoint.component_dir("text_encoder").expect("a dir"), &device, &opts).expect("it loads");
    same_report(&text_encoder.report, &loaded);
    assert!(!text_encoder.report.skipped.is_empty(), "{}", text_encoder.report);
    assert_eq!(initialised(&text_encoder.model), 0);

    let (_, vae) = checkpoint.bind_vae(&device, &opts).expect("the VAE binds");
    let (_, _, loaded) =
        AutoencoderKl::load(checkpoint.component_dir("vae").expect("a dir"), &device, &opts).expect("it loads");
    same_report(&vae.report, &loaded);
    assert_eq!(initialised(&vae.model), 0);
    assert_eq!(vae.report.to_string(), loaded.to_string());
}

#[test]
fn a_bad_checkpoint_is_the_loaders_typed_error() {
    let device = Device::flex();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let copy = dir.path().join("tiny");
    copy_dir(&fixtures().join("tiny-z-image-turbo"), &copy);
    // A transformer shard cut short: the loader's CorruptWeights, naming the file.
    let shard = copy.join("transformer/diffusion_pytorch_model-00002-of-00003.safetensors");
    let len = std::fs::metadata(&shard).expect("a shard").len();
    std::fs::OpenOptions::new().write(true).open(&shard).expect("opened").set_len(len - 100).expect("cut");
    let checkpoint = Checkpoint::open(&copy).expect("it opens");
    let error = checkpoint.bind_transformer(&device, &LoadOptions::new(), None).expect_err("refused");
    assert!(matches!(error, pipeline_zimage::Error::CorruptWeights { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains("it is truncated") && message.contains("re-download it"), "{message}");
    println!("{message}");
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("created");
    for entry in std::fs::read_dir(from).expect("listed") {
        let entry = entry.expect("an entry");
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copied");
        }
    }
}

/// A hard simulated card with room to spare.
fn card() -> Arc<SimCard> {
    SimCard::new(CardSpec::parse("1GiB").expect("a size").with_mode(Mode::Hard).with_context_overhead(0))
}

/// Replaces a pipeline component's registration with `bound`, registered from its files.
fn register_files<M>(pipeline: &ZImagePipeline, name: &str, bound: BoundComponent<M>) -> ModelHandle<M>
where
    M: group_offload::OffloadModel + Clone,
{
    let manager = pipeline.manager();
    let old = pipeline.component(name).expect("a component").id().to_string();
    manager.remove(&old).expect("the RAM copy leaves");
    ModelHandle::register_files(manager, name, bound.model, bound.files, pipeline.placement().clone())
        .expect("it registers from its files")
}

#[test]
fn the_text_encoder_and_the_transformer_stream_from_their_files_to_the_ram_paths_image() {
    let (opts, _) = turbo_options();
    let block = GroupOptions { releasable: true, ..GroupOptions::default() };

    let card_ram = card();
    let mut ram = load_tiny(OffloadDevice::simulated(card_ram.clone()));
    for component in ["text_encoder", "transformer"] {
        ram.enable_group_offload_with(component, &block).expect("group offload");
    }
    ram.enable_auto_offload(0, true).expect("auto offload");
    let want = values(ram.generate(&opts, &mut |_, _| {}).expect("the RAM path runs"));

    let device = Device::flex();
    let checkpoint = checkpoint();
    let card = card();
    let mut pipeline = load_tiny(OffloadDevice::simulated(card.clone()));
    let (_, text_encoder) = checkpoint.bind_text_encoder(&device, &LoadOptions::new(), None).expect("it binds");
    let transformer = checkpoint.bind_transformer(&device, &LoadOptions::new(), None).expect("it binds");
    let tables = [text_encoder.files.clone(), transformer.files.clone()];
    *pipeline.text_encoder_mut() = register_files(&pipeline, "text_encoder", text_encoder);
    *pipeline.transformer_mut() = register_files(&pipeline, "transformer", transformer);
    for component in ["text_encoder", "transformer"] {
        pipeline.enable_group_offload_with(component, &block).expect("group offload");
    }
    pipeline.enable_auto_offload(0, true).expect("auto offload");
    for run in 0..2 {
        let image = values(pipeline.generate(&opts, &mut |_, _| {}).expect("the file tier runs"));
        let same = image.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same && image.len() == want.len(), "run {run}: the file tier's image differs from the RAM path's");
    }
    for (component, table) in ["text_encoder", "transformer"].into_iter().zip(&tables) {
        let offload = pipeline.group_offload(component).expect("grouped");
        let stats = offload.stats();
        assert_eq!((stats.stray_loads, stats.misses), (0, 0), "{component}: {stats:?}");
        assert_eq!(offload.host_memory_bytes(), 0, "{component} holds weights in host memory");
        assert_eq!(table.materialised().0, 0, "{component}: {:?}", table.materialised());
        let totals = offload.disk_totals();
        assert!(totals.reads > 0 && totals.bytes >= offload.file_bytes(), "{component}: {totals:?}");
        println!("{component}: {}", offload.disk_rate().expect("timed"));
    }
    // The record's group rows say where each upload read its group from.
    let moves = pipeline.manager().offload_record().group_moves();
    assert!(moves.to_string().contains("prefetch, from file: "), "{moves}");
}

#[test]
fn a_transformer_quantized_as_it_is_read_equals_the_one_quantized_in_memory() {
    let device = Device::flex();
    let checkpoint = checkpoint();
    let (x, t, cap) = inputs(&device);
    let (loaded, _) = checkpoint.load_transformer(&device, &LoadOptions::new()).expect("it loads");
    let (quantized, count) = quantize_linear_weights(loaded, &int8_scheme());
    assert!(count > 0);
    let want = values(quantized.forward(x.clone(), t.clone(), cap.clone()));

    let transform = Arc::new(QuantizeLinearWeights { scheme: int8_scheme() });
    let bound = checkpoint.bind_transformer(&device, &LoadOptions::new(), Some(transform)).expect("it binds");
    let manager = Arc::new(offload_core::ComponentsManager::new());
    let mut handle =
        ModelHandle::register_files(&manager, "transformer", bound.model, bound.files, OffloadDevice::host_only())
            .expect("it registers");
    assert!(handle.is_quantized());
    handle.enable_group_offload(&GroupOptions::default()).expect("it streams");
    let got =
        values(handle.try_run(0, |weights, _| weights.forward(x.clone(), t.clone(), cap.clone())).expect("a forward"));
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "the quantized outputs differ");
    let spec = group_offload::apply::component_spec(&manager, &handle).expect("a spec");
    assert_eq!(spec.weight_bytes, group_offload::module_bytes(&quantized));
}

/// The transformer's golden inputs.
fn inputs(device: &Device) -> (Tensor<5>, Tensor<1>, Tensor<3>) {
    use burn::tensor::{DType, TensorData};
    let golden = common::golden("transformer.safetensors");
    let input = |name: &str| {
        let (shape, values) = &golden[name];
        TensorData::new(values.clone(), shape.clone())
    };
    let x = Tensor::<4>::from_data(input("x"), (device, DType::F32)).unsqueeze_dim(0);
    let t = Tensor::from_data(input("t"), (device, DType::F32));
    let cap = Tensor::<2>::from_data(input("cap_feats"), (device, DType::F32)).unsqueeze_dim(0);
    (x, t, cap)
}
