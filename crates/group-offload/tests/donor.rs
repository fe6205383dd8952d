//! A donor: a second simulated card whose memory holds streamed groups between their uploads. The groups it holds
//! are copied from it over its link (priced on the execution card as copies from a peer), the others from the
//! host; the output is the host-only run's bit for bit; the donor's own card is charged for what it holds and
//! gets it back when a group stays resident or the model goes; a donor that is the execution device, or a link
//! without a rate, is refused.

#![allow(clippy::unwrap_used)] // A test fails loudly at the first unexpected error.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use group_offload::config::PeerDonor;
use group_offload::prelude::*;
use memory_sim::{CardSpec, Mode, SimCard};
use offload_core::link::LinkRate;
use offload_core::{DeviceMemory, DeviceName};

#[derive(Module, Debug)]
struct Block {
    fc: Linear,
}

#[derive(Module, Debug, OffloadModel)]
struct Net {
    #[offload(blocks)]
    blocks: Vec<Block>,
}

const WIDTH: usize = 16;
const BLOCKS: usize = 4;
/// One block's bytes: the weight and the bias in f32.
const BLOCK: u64 = ((WIDTH * WIDTH + WIDTH) * 4) as u64;
/// The donor's link: slow enough that its copies stand out from the card's own host link.
const DONOR_RATE: f64 = 1e6;

fn net() -> Net {
    let device = Device::flex();
    Net { blocks: (0..BLOCKS).map(|_| Block { fc: LinearConfig::new(WIDTH, WIDTH).init(&device) }).collect() }
}

fn card(label: &str, device: &str) -> Arc<SimCard> {
    let mut spec = CardSpec::parse(label).unwrap().with_mode(Mode::Hard).with_context_overhead(0);
    spec.device = DeviceName::parse(device).unwrap();
    SimCard::new(spec)
}

/// What [`run`] saw.
struct Run {
    /// Each forward's output, as bits.
    outputs: Vec<Vec<u8>>,
    /// The execution card.
    exec: Arc<SimCard>,
    /// The groups on the donor after the forwards (bytes, count).
    held: (u64, usize),
    /// What the donor's card had allocated then, before the model was dropped.
    donor_allocated: Option<u64>,
    /// The probe's reading then ([`run_probed`]).
    probed: Option<u64>,
    /// The execution device's clocks: the copies from each peer, and the count of copies over its host link.
    peer_rates: Vec<(DeviceName, LinkRate)>,
    host_copies: usize,
}

/// Three forwards of `model` streamed block by block without prefetch (the order is then the call order), with
/// `donor` if given.
fn run(model: Net, donor: Option<PeerDonor>, resident_budget: u64) -> Run {
    run_with(model, donor, GroupOptions { prefetch: false, resident_budget, ..GroupOptions::default() })
}

/// [`run`] under `options`.
fn run_with(model: Net, donor: Option<PeerDonor>, options: GroupOptions) -> Run {
    run_probed(model, donor, options, None)
}

/// [`run_with`], reading `probe` after the forwards, before the model is dropped.
fn run_probed(model: Net, donor: Option<PeerDonor>, options: GroupOptions, probe: Option<&dyn Fn() -> u64>) -> Run {
    run_donors(model, donor.into_iter().collect(), options, probe).0
}

/// [`run_probed`] with any number of donors, added in order; also returns what each donor held.
fn run_donors(
    model: Net,
    donors: Vec<PeerDonor>,
    options: GroupOptions,
    probe: Option<&dyn Fn() -> u64>,
) -> (Run, Vec<(DeviceName, u64, usize)>) {
    let exec = card("1MB", "cuda:0");
    let (seen, holdings) = run_on(&OffloadDevice::simulated(exec.clone()), model, donors, options, probe);
    let run = Run {
        outputs: seen.outputs,
        exec,
        held: seen.held,
        donor_allocated: seen.donor_allocated,
        probed: seen.probed,
        peer_rates: seen.peer_rates,
        host_copies: seen.host_copies,
    };
    (run, holdings)
}

/// What [`run_on`] saw on any execution device.
struct Seen {
    outputs: Vec<Vec<u8>>,
    held: (u64, usize),
    /// What the first donor's simulated card had allocated after the forwards, where it is one.
    donor_allocated: Option<u64>,
    probed: Option<u64>,
    peer_rates: Vec<(DeviceName, LinkRate)>,
    host_copies: usize,
}

/// Three forwards of `model` on `device` with `donors`, the input on the device.
fn run_on(
    device: &OffloadDevice,
    model: Net,
    donors: Vec<PeerDonor>,
    options: GroupOptions,
    probe: Option<&dyn Fn() -> u64>,
) -> (Seen, Vec<(DeviceName, u64, usize)>) {
    // The first donor's card, asked for from its device object.
    let donor_card = donors.first().and_then(|donor| donor.device.account::<SimCard>());
    let mut handle = device.register("net", model).unwrap();
    for donor in donors {
        handle.add_donor(donor).unwrap();
    }
    handle.enable_group_offload(&options).unwrap();
    device.enable_auto_offload(0).unwrap();
    let input = Tensor::<2>::from_floats([[0.5; WIDTH], [-0.25; WIDTH]], device.exec());
    let mut outputs = Vec::new();
    for _ in 0..3 {
        let out = handle
            .run(0, |weights, _| weights.blocks.fold(input.clone(), |block, x| Ok(leaf!(block, fc).forward(x))))
            .unwrap();
        outputs.push(out.into_data().as_bytes().to_vec());
    }
    let offload = handle.group_offload().unwrap();
    let seen = Seen {
        outputs,
        held: offload.donor_bytes(),
        donor_allocated: donor_card.map(|card| card.allocated()),
        probed: probe.map(|p| p()),
        peer_rates: device.peer_rates(),
        host_copies: device.link_rate().map_or(0, |rate| rate.uploads),
    };
    (seen, offload.donor_holdings())
}

#[test]
fn the_groups_a_donor_holds_are_copied_from_it_and_the_output_is_the_host_runs() {
    let model = net();
    let host_only = run(model.clone(), None, 0);
    let donor_card = card("1MB", "cuda:1");
    // Room for two of the four blocks: the first two uploaded keep a copy on the donor.
    let donor = PeerDonor::new(OffloadDevice::simulated(donor_card.clone()), 2 * BLOCK + BLOCK / 2, DONOR_RATE);
    let with_donor = run(model.clone(), Some(donor), 0);
    assert_eq!(with_donor.outputs, host_only.outputs, "the donor's copies give the host run's output bit for bit");
    assert_eq!(with_donor.held, (2 * BLOCK, 2));
    assert_eq!(with_donor.donor_allocated, Some(2 * BLOCK), "the donor's card is charged for what it holds");
    assert_eq!(donor_card.allocated(), 0, "and gets it back when the model goes");
    // The first forward uploads every block from the host; the two later ones take blocks 0 and 1 from the donor.
    let (with, without) = (with_donor.exec.stats(), host_only.exec.stats());
    assert_eq!(with.bytes_from_peers, 2 * 2 * BLOCK);
    assert_eq!(with.bytes_to_device, without.bytes_to_device, "the same bytes arrive, from two places");
    // Four block copies left the card's own link (pageable host copies) for the donor's, priced on the execution
    // card at the donor's rate.
    let host_copy = host_only.exec.spec().timing.pageable_transfer_seconds(BLOCK);
    let peer = BLOCK as f64 / DONOR_RATE;
    let expected = without.transfer_seconds + 4.0 * (peer - host_copy);
    assert!((with.transfer_seconds - expected).abs() < 1e-12, "{} against {expected}", with.transfer_seconds);
    // The execution device's clocks: the four copies from the donor on cuda:1's meter, none of them on the host
    // link's, which timed four copies fewer than in the host-only run.
    let cuda1 = DeviceName::parse("cuda:1").unwrap();
    assert_eq!(with_donor.peer_rates.len(), 1);
    let (peer, rate) = &with_donor.peer_rates[0];
    assert_eq!((peer, rate.uploads, rate.bytes), (&cuda1, 4, 4 * BLOCK));
    assert!(rate.median.is_finite() && rate.median > 0.0, "{rate}");
    assert_eq!(host_only.host_copies - with_donor.host_copies, 4);
    assert!(host_only.peer_rates.is_empty());
}

/// Two donors: a group goes to the first, in the order added, with room; each holds its own share, each upload
/// copied from one is timed on that one's meter, and the output is the host run's bit for bit. A plan's budgets
/// order the donors as its peers, whatever order they were added in.
#[test]
fn a_model_takes_several_donors_each_group_to_the_first_with_room() {
    let model = net();
    let host_only = run(model.clone(), None, 0);
    let donors = |first: u64, second: u64| {
        let one = PeerDonor::new(OffloadDevice::simulated(card("1MB", "cuda:1")), first, DONOR_RATE);
        let two = PeerDonor::new(OffloadDevice::simulated(card("1MB", "cuda:2")), second, DONOR_RATE * 2.0);
        vec![one, two]
    };
    let options = || GroupOptions { prefetch: false, ..GroupOptions::default() };
    let name = |text: &str| DeviceName::parse(text).unwrap();
    // Room for one block on cuda:1 and two on cuda:2: blocks 0 on cuda:1, 1 and 2 on cuda:2, 3 from the host.
    let (run, held) = run_donors(model.clone(), donors(BLOCK, 2 * BLOCK), options(), None);
    assert_eq!(run.outputs, host_only.outputs);
    assert_eq!(held, vec![(name("cuda:1"), BLOCK, 1), (name("cuda:2"), 2 * BLOCK, 2)]);
    // The two later forwards copy block 0 from cuda:1 and blocks 1 and 2 from cuda:2: each on its own meter.
    let copies: Vec<(DeviceName, usize)> =
        run.peer_rates.iter().map(|(peer, rate)| (peer.clone(), rate.uploads)).collect();
    assert_eq!(copies, vec![(name("cuda:1"), 2), (name("cuda:2"), 4)]);
    assert_eq!(run.exec.stats().bytes_from_peers, 2 * 3 * BLOCK);
    assert_eq!(host_only.host_copies - run.host_copies, 6);

    // A plan's budgets: cuda:2 first with two blocks, cuda:1 one; added cuda:1 first, the plan's order counts.
    let budgets = vec![("cuda:2".to_string(), 2 * BLOCK), ("cuda:1".to_string(), BLOCK)];
    let planned = GroupOptions { donor_budgets: budgets, ..options() };
    let (run, held) = run_donors(model.clone(), donors(4 * BLOCK, 4 * BLOCK), planned, None);
    assert_eq!(run.outputs, host_only.outputs);
    assert_eq!(held, vec![(name("cuda:2"), 2 * BLOCK, 2), (name("cuda:1"), BLOCK, 1)]);

    // A device given twice is refused when the model starts streaming, naming the fix.
    let device = OffloadDevice::simulated(card("1MB", "cuda:0"));
    let twice = OffloadDevice::simulated(card("1MB", "cuda:1"));
    let mut handle = device.register("net", net()).unwrap();
    handle.add_donor(PeerDonor::new(twice.clone(), BLOCK, DONOR_RATE)).unwrap();
    handle.add_donor(PeerDonor::new(twice, BLOCK, DONOR_RATE)).unwrap();
    let error = handle.enable_group_offload(&options()).unwrap_err();
    assert!(error.to_string().contains("cuda:1 is given as a donor twice; add each device once"), "{error}");
}

/// Blocks of two sizes (two without a bias, two with) and two donors of one of each: by budgets, the two small
/// blocks fill the first donor and a large one is left on the host; given the sizes a plan placed on each
/// (`GroupOptions::donor_groups`), each donor takes one of each and all four live on the donors.
#[test]
fn given_the_plans_sizes_each_donor_takes_exactly_groups_of_those_sizes() {
    let device = Device::flex();
    let model = Net {
        blocks: (0..BLOCKS)
            .map(|i| Block { fc: LinearConfig::new(WIDTH, WIDTH).with_bias(i >= 2).init(&device) })
            .collect(),
    };
    let (small, large) = (BLOCK - (WIDTH * 4) as u64, BLOCK);
    let host_only = run(model.clone(), None, 0);
    let donors = || {
        let one = PeerDonor::new(OffloadDevice::simulated(card("1MB", "cuda:1")), small + large, DONOR_RATE);
        let two = PeerDonor::new(OffloadDevice::simulated(card("1MB", "cuda:2")), small + large, DONOR_RATE);
        vec![one, two]
    };
    let name = |text: &str| DeviceName::parse(text).unwrap();
    let by_budgets = GroupOptions { prefetch: false, ..GroupOptions::default() };
    let (run_budgets, held) = run_donors(model.clone(), donors(), by_budgets.clone(), None);
    assert_eq!(run_budgets.outputs, host_only.outputs);
    assert_eq!(held, vec![(name("cuda:1"), 2 * small, 2), (name("cuda:2"), large, 1)]);
    let sizes = vec![("cuda:1".to_string(), vec![small, large]), ("cuda:2".to_string(), vec![large, small])];
    let by_sizes = GroupOptions { donor_groups: sizes, ..by_budgets };
    let (run_sizes, held) = run_donors(model, donors(), by_sizes, None);
    assert_eq!(run_sizes.outputs, host_only.outputs);
    assert_eq!(held, vec![(name("cuda:1"), small + large, 2), (name("cuda:2"), small + large, 2)]);
}

/// A group that will stay resident is not pinned: the pinned budget goes to groups that stream. With a resident
/// budget of one block and a pinned budget of two, block 0 stays resident and blocks 1 and 2 are pinned, so the
/// two later forwards copy them from pinned memory too (six pinned copies, where pinning blocks 0 and 1 would make
/// four).
#[test]
fn the_pinned_budget_skips_the_groups_that_stay_resident() {
    let options =
        GroupOptions { prefetch: false, resident_budget: BLOCK, pinned_budget: 2 * BLOCK, ..GroupOptions::default() };
    let model = net();
    let pinned = run_with(model.clone(), None, options);
    assert_eq!(pinned.outputs, run(model, None, 0).outputs);
    assert_eq!(pinned.exec.stats().bytes_pinned_to_device, 6 * BLOCK);
}

/// Which groups stay resident and which are pinned is decided once, as the groups are added, so a model that calls
/// its blocks in another order than it declares them pins no group that then stays resident. Calling the four
/// blocks last to first, with a resident budget of one block and a pinned budget of three: block 0 (the first
/// declared) stays resident, and blocks 1 to 3 stream from pinned memory at every forward (nine pinned copies).
/// When residency went to the first group released, block 3 stayed resident after its pinned first upload, and the
/// run made seven pinned copies where its plan counted nine.
#[test]
fn residency_and_pinning_are_chosen_in_declaration_order_whatever_the_call_order() {
    let model = net();
    let reversed = |options: GroupOptions| {
        let exec = card("1MB", "cuda:0");
        let device = OffloadDevice::simulated(exec.clone());
        let mut handle = device.register("net", model.clone()).unwrap();
        handle.enable_group_offload(&options).unwrap();
        let input = Tensor::<2>::from_floats([[0.5; WIDTH], [-0.25; WIDTH]], &Device::flex());
        let outputs: Vec<Vec<u8>> = (0..3)
            .map(|_| {
                let out = handle
                    .run(0, |weights, _| {
                        let mut x = input.clone();
                        for index in (0..BLOCKS).rev() {
                            let block = weights.blocks.get(index).unwrap()?;
                            x = leaf!(block, fc).forward(x);
                        }
                        Ok(x)
                    })
                    .unwrap();
                out.into_data().as_bytes().to_vec()
            })
            .collect();
        (outputs, exec.stats())
    };
    let plain = GroupOptions { prefetch: false, ..GroupOptions::default() };
    let (expected, streamed) = reversed(plain.clone());
    let options = GroupOptions { resident_budget: BLOCK, pinned_budget: 3 * BLOCK, ..plain };
    let (outputs, stats) = reversed(options);
    assert_eq!(outputs, expected, "the same output, bit for bit");
    assert_eq!(streamed.bytes_to_device, 12 * BLOCK, "without budgets every block streams at every forward");
    assert_eq!(stats.bytes_pinned_to_device, 9 * BLOCK, "blocks 1 to 3, three forwards each");
    assert_eq!(stats.bytes_to_device, 10 * BLOCK, "block 0 once, the others three times");
}

/// What the peer meter measured is what the next plan prices the peer at: its run's figures, measured, in place of
/// the declared rate.
#[test]
fn the_copies_from_a_donor_are_timed_on_its_peer_meter_and_a_plan_prices_the_peer_at_their_rate() {
    use offload_core::plan::{LinkSource, MeasuredPeer, PeerDevice, PeerRun};
    let donor_card = card("1MB", "cuda:1");
    let donor = PeerDonor::new(OffloadDevice::simulated(donor_card), 4 * BLOCK, DONOR_RATE);
    let run = run(net(), Some(donor), 0);
    let (_, rate) = run.peer_rates.first().expect("the donor's copies were timed");
    let stored = PeerRun::from_rate(Some(*rate)).expect("copies timed");
    assert_eq!((stored.copies, stored.bytes, stored.median), (8, 8 * BLOCK, rate.median));
    let measured = MeasuredPeer::from_runs(&[stored]).expect("one run");
    let peer = PeerDevice::new("cuda:1", 4 * BLOCK, DONOR_RATE, 0.0).with_measured(Some(measured));
    assert_eq!((peer.bytes_per_second, peer.source), (rate.median, LinkSource::Measured { runs: 1, uploads: 8 }));
}

#[test]
fn a_group_that_stays_resident_gives_its_donor_copy_back_and_the_donor_is_emptied_with_the_model() {
    let model = net();
    let host_only = run(model.clone(), None, BLOCK);
    let donor_card = card("1MB", "cuda:1");
    let donor = PeerDonor::new(OffloadDevice::simulated(donor_card.clone()), 2 * BLOCK, DONOR_RATE);
    // Block 0 stays resident after its first release (a resident budget of one block): its copy on the donor goes
    // back, and blocks 1 and 2 take the donor's room.
    let with_donor = run(model, Some(donor), BLOCK);
    assert_eq!(with_donor.outputs, host_only.outputs);
    assert_eq!(with_donor.held, (2 * BLOCK, 2), "blocks 1 and 2, not the resident block 0");
    assert_eq!(with_donor.donor_allocated, Some(2 * BLOCK));
    // `run` dropped the handle: its component, and with it every copy on the donor, is gone.
    assert_eq!(donor_card.allocated(), 0, "the donor's card got everything back");
}

#[test]
fn a_donor_that_is_the_execution_device_or_has_no_rate_is_refused() {
    let exec = card("1MB", "cuda:0");
    let device = OffloadDevice::simulated(exec);
    let mut handle = device.register("net", net()).unwrap();
    handle.add_donor(PeerDonor::new(device.clone(), BLOCK, DONOR_RATE)).unwrap();
    let error = handle.enable_group_offload(&GroupOptions::default()).unwrap_err();
    assert!(error.to_string().contains("the donor is the execution device"), "{error}");

    let mut handle = device.register("other", net()).unwrap();
    let elsewhere = OffloadDevice::simulated(card("1MB", "cuda:1"));
    handle.add_donor(PeerDonor::new(elsewhere, BLOCK, f64::NAN)).unwrap();
    let error = handle.enable_group_offload(&GroupOptions::default()).unwrap_err();
    assert!(error.to_string().contains("give a finite positive rate"), "{error}");

    // Once the model streams, a donor cannot be added under it.
    let mut handle = device.register("late", net()).unwrap();
    handle.enable_group_offload(&GroupOptions::default()).unwrap();
    let late = PeerDonor::new(OffloadDevice::simulated(card("1MB", "cuda:2")), BLOCK, DONOR_RATE);
    assert!(matches!(handle.add_donor(late), Err(group_offload::Error::AlreadyApplied { .. })));
}

#[test]
fn a_planned_donor_budget_caps_what_the_donor_holds_and_a_donor_the_plan_did_not_name_holds_nothing() {
    let model = net();
    let host_only = run(model.clone(), None, 0);
    let planned = |budgets: Vec<(String, u64)>| {
        let donor_card = card("1MB", "cuda:1");
        // The donor's own budget takes every block; the plan's share is what counts.
        let donor = PeerDonor::new(OffloadDevice::simulated(donor_card.clone()), 4 * BLOCK, DONOR_RATE);
        let options = GroupOptions { prefetch: false, donor_budgets: budgets, ..GroupOptions::default() };
        let run = run_with(model.clone(), Some(donor), options);
        assert_eq!(run.outputs, host_only.outputs);
        run.held
    };
    assert_eq!(planned(vec![("cuda:1".into(), BLOCK + BLOCK / 2)]), (BLOCK, 1), "the plan's share: one block");
    assert_eq!(planned(vec![("cuda:2".into(), 4 * BLOCK)]), (0, 0), "the plan placed nothing on cuda:1");
    assert_eq!(planned(Vec::new()), (4 * BLOCK, 4), "no plan: the donor's own budget");
}

#[test]
fn a_pinned_group_streams_from_the_host_and_the_donor_takes_the_groups_after_it() {
    let model = net();
    let host_only = run(model.clone(), None, 0);
    let donor_card = card("1MB", "cuda:1");
    let donor = PeerDonor::new(OffloadDevice::simulated(donor_card.clone()), 4 * BLOCK, DONOR_RATE);
    // The first two blocks registered are pinned (the pinned budget, a plan's pinned share); the donor, with room
    // for all four, takes the two after them.
    let options = GroupOptions { prefetch: false, pinned_budget: 2 * BLOCK, ..GroupOptions::default() };
    let run = run_probed(model, Some(donor), options, Some(&|| donor_card.peak()));
    assert_eq!(run.probed, Some(2 * BLOCK), "the donor's card never held a pinned block");
    assert_eq!(run.outputs, host_only.outputs);
    assert_eq!(run.held, (2 * BLOCK, 2), "blocks 2 and 3; the pinned blocks 0 and 1 stay with the host");
    assert_eq!(run.exec.stats().bytes_from_peers, 2 * 2 * BLOCK, "two later forwards take blocks 2 and 3 from it");
}

/// A donor on a real runtime: burn's wgpu device (Vulkan; Mesa's lavapipe on a CPU-only machine) holds the card's
/// streamed groups, each copied across runtimes twice (onto the donor after its first upload, from it at every
/// later one: burn's `Tensor::to_device`, the call a second GPU's copies take). The output is the host-only run's
/// bit for bit; the runtime's own pool holds the groups while the model lives and gives them back when it goes.
/// `cargo test -p group-offload --features wgpu --test donor`.
#[cfg(feature = "wgpu")]
#[test]
fn a_wgpu_device_holds_streamed_groups_for_a_card_and_its_pool_gives_them_back() {
    use group_offload::device::{PagePolicy, open_device_with};
    let name = DeviceName::parse("wgpu").unwrap();
    let wgpu = open_device_with(&name, PagePolicy::Exclusive)
        .unwrap_or_else(|error| panic!("{error} (this test needs a Vulkan driver: Mesa's lavapipe on a CPU)"));
    let in_use = || wgpu.memory_pool_usage().expect("the runtime's pool readings").bytes_in_use;
    wgpu.memory_cleanup();
    let before = in_use();
    let model = net();
    let host_only = run(model.clone(), None, 0);
    // The donor's account accepts anything: what the donor holds is read from the runtime's own pool instead.
    let donor_device = OffloadDevice::on_device(wgpu.clone(), name, Arc::new(offload_core::NoLedger), None);
    let donor = PeerDonor::new(donor_device, 2 * BLOCK + BLOCK / 2, DONOR_RATE);
    let options = GroupOptions { prefetch: false, ..GroupOptions::default() };
    let with_donor = run_probed(model, Some(donor), options, Some(&in_use));
    assert_eq!(with_donor.outputs, host_only.outputs, "copies through the wgpu device give the host run's output");
    assert_eq!(with_donor.held, (2 * BLOCK, 2), "the first two blocks uploaded, as the budget takes");
    // Exclusive pages: each sized to its allocation, so the pool holds the two blocks' tensors.
    let pool = with_donor.probed.unwrap() - before;
    println!("the wgpu pool held {pool} bytes for the donor's {} bytes of groups", with_donor.held.0);
    // The copies from the wgpu device were timed on its peer meter: a real runtime's copies, by the clock.
    let (peer, rate) = with_donor.peer_rates.first().expect("the donor's copies were timed");
    println!("copies from {peer} onto the card: {rate}");
    assert_eq!((rate.uploads, rate.bytes), (4, 4 * BLOCK), "blocks 0 and 1 at the two later forwards");
    assert!(pool >= 2 * BLOCK, "the wgpu pool holds the donor's groups: {pool} bytes in use over {before}");
    wgpu.memory_cleanup();
    assert_eq!(in_use(), before, "the donor's pool got every group back when the model went");
}

/// Two simulated cards compute on the host's one CPU backend: a copy between them crosses no link, so timing one
/// is refused with the fix (declare the link's rate), and nothing is charged to either card.
#[test]
fn copies_between_two_simulated_cards_are_not_timed() {
    let (exec_card, donor_card) = (card("1MB", "cuda:0"), card("1MB", "cuda:1"));
    let exec = OffloadDevice::simulated(exec_card.clone());
    let donor = OffloadDevice::simulated(donor_card.clone());
    let error = exec.time_copies_from(&donor, BLOCK, 3).expect_err("no link to time");
    assert!(matches!(error, group_offload::Error::PeerCopy { .. }), "{error}");
    let text = error.to_string();
    assert!(text.starts_with("cannot time copies from cuda:1 onto cuda:0: both compute on"), "{text}");
    assert!(text.contains("declare the link's rate instead"), "{text}");
    let error = PeerDonor::timed(&exec, donor, None, BLOCK).expect_err("nothing to time, nothing measured");
    assert!(matches!(error, group_offload::Error::PeerCopy { .. }), "{error}");
    assert_eq!((exec_card.allocated(), donor_card.allocated()), (0, 0));
}

/// A second wgpu runtime beside `wgpu:0`, each with its own wgpu device, queue and memory pool: `wgpu:1` where the
/// machine lists a second adapter, else (a CPU with lavapipe, as in CI) a runtime of its own on the one adapter,
/// selected by its kind (burn's `DeviceKind::Cpu`, another runtime than the default's). Exclusive pages, so the
/// pool's bytes follow the tensors.
#[cfg(feature = "wgpu")]
fn second_wgpu_runtime() -> (DeviceName, Device) {
    use burn::tensor::DeviceKind;
    use burn::tensor::wgpu::MemoryConfiguration;
    use group_offload::device::{PagePolicy, open_device_with};
    let name = DeviceName::parse("wgpu:1").unwrap();
    match open_device_with(&name, PagePolicy::Exclusive) {
        Ok(device) => return (name, device),
        Err(error) => println!("{error}; a second runtime on the one adapter instead"),
    }
    static SECOND: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    let device = SECOND.get_or_init(|| {
        Device::wgpu_options()
            .device_kind(DeviceKind::Cpu)
            .memory_config(MemoryConfiguration::ExclusivePages)
            .init()
            .unwrap_or_else(|error| panic!("{error} (a second wgpu runtime, on lavapipe's CPU adapter)"))
    });
    (name, device.clone())
}

/// Two real runtimes: the model runs on burn's wgpu device `wgpu:0` and a second wgpu runtime (its own device,
/// queue and pool) holds its streamed groups, each copied between the runtimes by burn's `Tensor::to_device`, the
/// call two GPUs' copies take. The output is the one-runtime run's bit for bit (the same kernels on the same
/// adapter); the copies are timed on the execution device's meter for that peer; the second runtime's pool holds
/// the groups while the model lives and gets them back when it goes.
/// `cargo test -p group-offload --features wgpu --test donor`.
#[cfg(feature = "wgpu")]
#[test]
fn a_second_wgpu_runtime_holds_the_first_ones_streamed_groups() {
    use group_offload::device::{PagePolicy, open_device_with};
    let exec_name = DeviceName::parse("wgpu:0").unwrap();
    let exec = open_device_with(&exec_name, PagePolicy::Exclusive)
        .unwrap_or_else(|error| panic!("{error} (this test needs a Vulkan driver: Mesa's lavapipe on a CPU)"));
    let (donor_name, donor) = second_wgpu_runtime();
    assert_ne!(exec, donor, "two runtimes");
    let in_use = || donor.memory_pool_usage().expect("the second runtime's pool readings").bytes_in_use;
    donor.memory_cleanup();
    let before = in_use();
    let device = OffloadDevice::on_device(exec, exec_name, Arc::new(offload_core::NoLedger), None);
    let options = GroupOptions { prefetch: false, ..GroupOptions::default() };
    let model = net();
    let (alone, _) = run_on(&device, model.clone(), Vec::new(), options.clone(), None);
    let donor_device =
        OffloadDevice::on_device(donor.clone(), donor_name.clone(), Arc::new(offload_core::NoLedger), None);
    let peer = PeerDonor::new(donor_device.clone(), 2 * BLOCK + BLOCK / 2, DONOR_RATE);
    let (with_donor, holdings) = run_on(&device, model, vec![peer], options, Some(&in_use));
    assert_eq!(with_donor.outputs, alone.outputs, "copies from the second runtime give the one-runtime output");
    assert_eq!(holdings, vec![(donor_name.clone(), 2 * BLOCK, 2)], "the first two blocks, as the budget takes");
    let pool = with_donor.probed.unwrap() - before;
    println!("the second runtime's pool held {pool} bytes for {} bytes of groups", 2 * BLOCK);
    assert!(pool >= 2 * BLOCK, "the second runtime's pool holds the donor's groups: {pool} bytes over {before}");
    let rates: Vec<_> = with_donor.peer_rates.iter().filter(|(peer, _)| *peer == donor_name).collect();
    let [(_, rate)] = rates.as_slice() else { panic!("one meter for {donor_name}: {:?}", with_donor.peer_rates) };
    println!("copies from {donor_name} onto wgpu:0: {rate}");
    assert_eq!((rate.uploads, rate.bytes), (4, 4 * BLOCK), "blocks 0 and 1 at the two later forwards");
    donor.memory_cleanup();
    assert_eq!(in_use(), before, "the second runtime's pool got every group back when the model went");
    // Before any run, a plan prices the peer by timed copies of a probe from it: each copy timed to its synced
    // read-back, on a clock of its own (the device's meter for the peer keeps the run's copies), and nothing of
    // the probe stays on the peer.
    let noted = device.peer_rates();
    let probe = device.time_copies_from(&donor_device, 1 << 20, 5).expect("copies timed");
    println!("a probe of 1 MiB from {donor_name} onto wgpu:0, 5 copies: {probe}");
    assert_eq!((probe.uploads, probe.bytes), (5, 5 << 20));
    assert!(probe.median.is_finite() && probe.median > 0.0 && probe.p10 <= probe.median, "{probe:?}");
    assert_eq!(device.peer_rates(), noted, "the probe is not the run's copies");
    donor.memory_cleanup();
    assert_eq!(in_use(), before, "the probe went with its copies");
    // A donor priced by measurement: by the probe before any run measured the pair, then by the run's copies.
    use offload_core::plan::{LinkSource, MeasuredPeer, PeerRun};
    let (timed, peer) = PeerDonor::timed(&device, donor_device.clone(), None, 1 << 20).expect("priced by a probe");
    assert_eq!(peer.source, LinkSource::Measured { runs: 1, uploads: PeerDonor::PROBE_COPIES as u64 });
    assert_eq!((timed.bytes_per_second, timed.budget), (peer.bytes_per_second, peer.bytes));
    assert_eq!(peer.name, donor_name.as_str());
    let (_, rate) = rates[0];
    let earlier = MeasuredPeer::from_runs(&[PeerRun::from_rate(Some(*rate)).unwrap()]).unwrap();
    let (timed, peer) = PeerDonor::timed(&device, donor_device, Some(earlier), 1 << 20).expect("priced");
    assert_eq!((timed.bytes_per_second, peer.source), (rate.median, LinkSource::Measured { runs: 1, uploads: 4 }));
}
