//! A donor on a real runtime: burn's wgpu device (Vulkan; Mesa's lavapipe on a CPU-only machine) holds streamed
//! groups for a simulated card on the CPU backend. Each group is copied across runtimes twice: onto the donor
//! after its first upload, and from the donor at every later upload (burn's `Tensor::to_device`, the call a
//! second GPU's copies take). The output is the host-only run's bit for bit; the donor's memory pool, read from
//! the runtime, holds at least the groups' bytes while the model lives and gives them back when it goes.
//!
//! `cargo test -p group-offload --features wgpu --test donor_device`

#![cfg(feature = "wgpu")]
#![allow(clippy::unwrap_used)] // A test fails loudly at the first unexpected error.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use group_offload::config::PeerDonor;
use group_offload::device::{PagePolicy, open_device_with};
use group_offload::prelude::*;
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::{DeviceName, NoLedger};

#[derive(Module, Debug)]
struct Block {
    fc: Linear,
}

#[derive(Module, Debug, OffloadModel)]
struct Net {
    #[offload(blocks)]
    blocks: Vec<Block>,
}

const WIDTH: usize = 64;
const BLOCKS: usize = 4;
/// One block's bytes: the weight and the bias in f32.
const BLOCK: u64 = ((WIDTH * WIDTH + WIDTH) * 4) as u64;

fn net() -> Net {
    let device = Device::flex();
    Net { blocks: (0..BLOCKS).map(|_| Block { fc: LinearConfig::new(WIDTH, WIDTH).init(&device) }).collect() }
}

/// What [`run`] saw.
struct Run {
    /// Each forward's output, as bits.
    outputs: Vec<Vec<u8>>,
    /// What the donor held after the forwards (bytes, groups).
    held: (u64, usize),
    /// `probe`'s reading then, while the model still lived.
    probed: u64,
}

/// Three forwards of `model` streamed block by block without prefetch on a simulated 1 MB card, with `donor` if
/// given; `probe` is read after them, before the model is dropped.
fn run(model: Net, donor: Option<PeerDonor>, probe: impl FnOnce() -> u64) -> Run {
    let card = SimCard::new(CardSpec::parse("1MB").unwrap().with_mode(Mode::Hard).with_context_overhead(0));
    let device = OffloadDevice::simulated(card);
    let mut handle = device.register("net", model).unwrap();
    if let Some(donor) = donor {
        handle.set_donor(donor).unwrap();
    }
    handle.enable_group_offload(&GroupOptions { prefetch: false, ..GroupOptions::default() }).unwrap();
    device.enable_auto_offload(0).unwrap();
    let input = Tensor::<2>::from_floats([[0.5; WIDTH], [-0.25; WIDTH]], &Device::flex());
    let mut outputs = Vec::new();
    for _ in 0..3 {
        let out = handle
            .run(0, |weights, _| weights.blocks.fold(input.clone(), |block, x| Ok(leaf!(block, fc).forward(x))))
            .unwrap();
        outputs.push(out.into_data().as_bytes().to_vec());
    }
    Run { outputs, held: handle.group_offload().unwrap().donor_bytes(), probed: probe() }
}

#[test]
fn a_wgpu_device_holds_streamed_groups_for_a_card_and_its_pool_gives_them_back() {
    let name = DeviceName::parse("wgpu").unwrap();
    let wgpu = open_device_with(&name, PagePolicy::Exclusive)
        .unwrap_or_else(|error| panic!("{error} (this test needs a Vulkan driver: Mesa's lavapipe on a CPU)"));
    let in_use = || wgpu.memory_pool_usage().expect("the runtime's pool readings").bytes_in_use;
    wgpu.memory_cleanup();
    let before = in_use();
    let model = net();
    let host_only = run(model.clone(), None, || 0);
    // The donor's account accepts anything: what the donor holds is read from the runtime's own pool instead.
    let donor_device = OffloadDevice::on_device(wgpu.clone(), name, Arc::new(NoLedger), None);
    let donor = PeerDonor::new(donor_device, 2 * BLOCK + BLOCK / 2, 1e9);
    let with_donor = run(model, Some(donor), in_use);
    assert_eq!(
        with_donor.outputs, host_only.outputs,
        "groups copied through the wgpu device give the host run's output bit for bit"
    );
    assert_eq!(with_donor.held, (2 * BLOCK, 2), "the first two blocks uploaded, as the budget takes");
    // The pool's pages hold the two blocks' tensors (exclusive pages: each sized to its allocation).
    let pool = with_donor.probed - before;
    println!("the wgpu pool held {pool} bytes for the donor's {} bytes of groups", with_donor.held.0);
    assert!(pool >= 2 * BLOCK, "the wgpu pool holds the donor's groups: {pool} bytes in use over {before}");
    wgpu.memory_cleanup();
    assert_eq!(in_use(), before, "the donor's pool got every group back when the model went");
}
