//! Everything burn-facing a model crate needs to run its models on a device with less memory than their weights:
//! whole-component moves, group offload inside one model (block-level and leaf-level groups streamed through the
//! device, prefetched on a worker thread in the order the model calls them), presets applied, and real devices.
//!
//! # A model crate
//!
//! A model crate imports [`prelude`] and learns the ten concepts of `docs/model-guide.md`:
//!
//! 1. Declare each model once, on its struct: `#[derive(OffloadModel)]` with `#[offload(blocks)]`,
//!    `#[offload(block)]` or `#[offload(nested)]` on the fields that stream ([`OffloadModel`]). Nested lists (a
//!    UNet's stages), several lists and single modules are all declared in the shape the struct already has, and
//!    checkpoint keys do not change.
//! 2. Write each model's forward once, over its weights view: [`Blocks`] (by index, iteration or fold),
//!    [`Single`], [`Nested`], [`Shell`]; inside a block, a [`Layer`], whose leaves [`leaf!`] takes by their field
//!    paths and which [`narrow!`] narrows to a sub-module ([`Layer::some`] to an optional one). The resident
//!    forward is the same function. [`check_streaming`] is its free test.
//! 3. Register each model with a `ComponentsManager` as a [`ModelHandle`] on a [`OffloadDevice`] (the device's one
//!    account), and call it with [`ModelHandle::run`]: auto offload, the OOM retry and the record apply.
//! 4. Stream a model with [`ModelHandle::enable_group_offload`] and [`GroupOptions`], or plan every component
//!    for the device with [`component_spec`] and [`apply_plan`].
//!
//! `examples/tiny-dit` is a whole pipeline built this way. The rest of this page is the mechanism underneath:
//! group offload driven by hand.
//!
//! # The pattern
//!
//! burn has no forward hooks, so groups are explicit. The model hands its weights to a [`GroupOffload`] once,
//! as parts: a list of blocks ([`GroupOffload::blocks`]), a module cut at its leaf layers
//! ([`GroupOffload::leaves`]), or a whole module ([`GroupOffload::module`], resident by default, for the layers
//! outside the blocks). The weights move into a host store (one exact-size host copy per group, or one
//! safetensors file per group), and the model's forward walks its groups through guards:
//!
//! ```
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::tensor::{Device, Tensor};
//! use group_offload::config::GroupOffloadConfig;
//! use group_offload::parts::{GroupOffload, Residency};
//!
//! #[derive(Module, Debug)]
//! struct Block { fc: Linear }
//!
//! let device = Device::flex();
//! let blocks: Vec<Block> = (0..4).map(|_| Block { fc: LinearConfig::new(8, 8).init(&device) }).collect();
//! let head = LinearConfig::new(8, 2).init(&device);
//!
//! let offload = GroupOffload::new(GroupOffloadConfig::new("tiny", device.clone()))?;
//! let blocks = offload.blocks("blocks", blocks, 1)?;
//! let head = offload.module("head", head, Residency::Resident)?;
//!
//! // One forward is one `run`: the first is the capture of the order the groups are taken in.
//! let forward = |x: Tensor<2>| offload.run(|| -> Result<Tensor<2>, group_offload::Error> {
//!     offload.ensure_device(&x.device())?;
//!     let mut x = x;
//!     for group in blocks.iter() {
//!         let group = group?;                // on the device while borrowed
//!         for block in group.iter() {
//!             x = block.fc.forward(x);
//!         }
//!     }                                      // dropped: offloaded, the next one is already prefetched
//!     Ok(head.get()?.forward(x))
//! });
//! let x = Tensor::<2>::ones([1, 8], &device);
//! let first = forward(x.clone())?;           // the capture pass: blocking, records the call order
//! let second = forward(x)?;                  // prefetched in the captured order
//! assert_eq!(first.into_data(), second.into_data());
//! let stats = offload.stats();
//! assert_eq!((stats.misses, stats.order_inserts), (0, 0));
//! assert!(stats.prefetch_hits + stats.prefetch_waits > 0);
//! # Ok::<(), group_offload::Error>(())
//! ```
//!
//! # What happens underneath
//!
//! - **Capture.** The first forward runs blocking: every group is uploaded when taken, and the order of the
//!   takes is recorded, a part taken twice as two steps. The capture is exactly the first forward: it ends when
//!   the first [`GroupOffload::run`] returns (which [`ModelHandle::run`] and [`check_streaming`] call), however
//!   often a part is taken inside it, or at [`GroupOffload::end_capture`]. Order comes from calls, never from
//!   declaration (diffusers #11307).
//! - **Prefetch.** After the capture, taking group *k* hands the next `prefetch_depth` groups of the captured
//!   order (wrapping into the next forward) to a worker thread, which allocates them on the
//!   [`DeviceLedger`](offload_core::DeviceLedger), pays the transfer, and builds the device tensors. On CUDA each
//!   OS thread is its own burn stream, so the worker is the copy stream and burn orders cross-stream use with
//!   events. Prefetched groups that fall out of the window are dropped.
//! - **Ring bound.** With guards taken one at a time, the device holds at most
//!   `resident + (prefetch_depth + 1) × largest group` bytes of weights, plus activations.
//! - **Misses.** A group not on the device when taken after the capture is loaded synchronously and counted in
//!   [`GroupStats::misses`]. A group first seen after the capture (a conditional module, diffusers #13211) is
//!   inserted into the order right after the group taken before it, so the next forward prefetches it.
//! - **Several blocks per group** prefetch correctly: the group is the unit of upload, prefetch and release.
//! - **Accounting.** Every move calls the ledger (allocate, then transfer, before an upload; free after an
//!   offload) and, when configured, adds an [`OffloadEvent`](offload_core::OffloadEvent) with id
//!   `"{model}/{group}"` and reason `group_onload`, `prefetch` or `group_offload` to the
//!   [`OffloadRecord`](offload_core::OffloadRecord). A failed upload frees what it took; the host copy is never
//!   touched by an upload.
//! - **Timeline.** With [`GroupOffloadConfig::with_timeline`], each group's upload, compute (the life of its
//!   guard) and release is a span of the [`Timeline`](offload_core::Timeline) on the thread it happened on (a
//!   prefetch on the worker's), followed by a device memory sample after each move.
//! - **Host memory.** Taking a model apart consumes it: each tensor is read into host bytes (zero-copy on a CPU
//!   backend when the tensor is not shared) and the model keeps only placeholders that own no memory, so the
//!   host copy is the only copy. Uploads clone shared handles to those bytes. With a disk store the bytes are
//!   dropped once written and every upload reads the group's file.
//! - **The file tier.** A model bound to its checkpoint files ([`weights`]: [`weights::WeightIndex`],
//!   [`weights::bind`]) and registered with [`ModelHandle::register_files`] keeps no host copy in memory at all:
//!   every group is read from the checkpoint files with positioned reads when it is uploaded (on the prefetch
//!   worker when prefetched), in the dtype the files store. Its sizes and layout come from the
//!   [`weights::FileTable`], never from reading it. Every read is timed on a disk meter (the offloader's
//!   [`GroupOffload::disk_rate`](parts::GroupOffload::disk_rate)), a `file_read` span and the record's `from file`
//!   read.
//! - **Manager.** [`GroupOffloadedModel`] registers the model with a
//!   [`ComponentsManager`](offload_core::ComponentsManager) as group-offloaded, so auto offload never evicts it.
//!
//! # Real devices
//!
//! [`device`] opens burn devices by name ([`open_device`]), reads a cubecl device's memory ([`PoolReadings`]),
//! imposes a smaller card over those readings ([`CappedDevice`]), and is the one boundary where a device's
//! failures become typed errors ([`run_call`], [`check_device`]): uploads and calls report success only once
//! one value of each of their tensors was read back, since cubecl reports a failed allocation at the next read.
//! Only the library's own device operations (upload, sync, read-back) are guarded against a runtime's panic,
//! never the model's forward (`docs/devices.md`). On wgpu over Vulkan the device's size is its largest
//! device-local heap, or that heap's budget where the driver offers `VK_EXT_memory_budget`, read from
//! `vulkaninfo` ([`vulkaninfo`]) when the device opens.
//!
//! Int and bool parameters are not offloaded: they move to the execution device when the part is added and
//! stay there, uncounted. Quantized float parameters (burn's `QFloat`) stream like any other: their host copy is
//! burn's quantized bytes (values and scales), an upload rebuilds the quantized tensor in its own shape, and
//! every size is the quantized one; [`quant`] says which schemes the backend in use computes.

#![forbid(unsafe_code)]

/// The model author's guide, `docs/model-guide.md`: its Rust examples are compiled and run as this crate's
/// doctests (`cargo test -p group-offload --doc`), so the guide cannot show a name that no longer exists.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/model-guide.md")]
struct ModelGuide;

// The mechanism's names the page above links to, which the root does not export.
#[cfg(doc)]
use {
    apply::{apply_plan, component_spec},
    component::GroupOffloadedModel,
    config::GroupOffloadConfig,
    device::{CappedDevice, PoolReadings, check_device, open_device, run_call},
    engine::GroupStats,
    parts::GroupOffload,
};

pub mod apply;
pub mod bench;
pub mod component;
pub mod config;
pub mod device;
pub mod engine;
pub mod error;
pub mod handle;
pub mod model;
pub mod offload_device;
pub mod parts;
mod paths;
pub mod prelude;
pub mod quant;
mod store;
mod uploads;
pub mod view;
pub mod vulkaninfo;
mod walk;
pub mod weights;
pub mod whole;

// The root holds what a model author meets (`docs/model-guide.md`); the mechanism stays in its modules.
pub use config::LeafPredicate;
pub use error::{Error, Result};
/// `#[derive(OffloadModel)]`: see [`OffloadModel`].
pub use group_offload_derive::OffloadModel;
pub use handle::ModelHandle;
pub use model::{GroupLevel, GroupOptions, OffloadModel, check_streaming, whole};
pub use offload_device::OffloadDevice;
pub use view::{Blocks, Layer, Nested, Part, Shell, Single};
pub use whole::module_bytes;
