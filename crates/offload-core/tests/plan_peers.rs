//! Further devices as donors in a pipeline's plan ([`Machine::peers`]): the streamed groups placed over the peers'
//! memory, RAM and the checkpoint file by cost, each peer's budget shared by the components, and the placement
//! checked against an exhaustive search.

mod plan_common;

use expect_test::expect;
use offload_core::plan::{
    BlockLayout, ComponentSpec, Donor, DonorBudget, DonorKind, DonorProblem, HostMemory, Machine, PeerDevice,
    PlanError, Preset, Route, Settings, SettingsLayer, StreamedGroup, TimeModel, plan_pipeline,
};
use plan_common::{machine, z_image_turbo};

const GB: u64 = 1_000_000_000;
const MB: u64 = 1_000_000;

/// NVLink between two RTX 3090s (DisTorch's 0.02 s per GB) and PCIe 3.0 x8 (0.32 s per GB), 10 µs each.
fn nvlink(name: &str, bytes: u64) -> PeerDevice {
    PeerDevice::new(name, bytes, 50e9, 10e-6)
}

fn pcie3x8(name: &str, bytes: u64) -> PeerDevice {
    PeerDevice::new(name, bytes, 3.125e9, 10e-6)
}

fn settings(set: &[(&str, &str)]) -> Settings {
    let mut explicit = SettingsLayer { preset: Some(Preset::Auto), ..SettingsLayer::default() };
    for (key, value) in set {
        explicit.set(key, value).expect("the test's settings are valid");
    }
    Settings::resolve(&explicit, std::iter::empty::<(String, String)>(), None).expect("the test's settings are valid")
}

#[test]
fn a_peer_over_nvlink_holds_the_denoisers_groups_and_a_slow_one_holds_nothing_beside_ram() {
    let alone = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 32)).expect("plans");
    let with_peers = machine(8, 32).with_peer(nvlink("cuda:1", 4 * GB)).with_peer(pcie3x8("cuda:2", 24 * GB));
    let plan = plan_pipeline(&z_image_turbo(), Preset::Auto, &with_peers).expect("plans");
    expect![[r#"
        component     route                 host         resident  pinned  streamed/step  time/step     peak
        text_encoder  leaf, prefetch        ram         741.88 MB     0 B        7.49 GB    0.513 s  1.25 GB
        transformer   block x1, prefetch 1  ram+cuda:1    5.40 GB     0 B        6.74 GB    0.599 s  6.58 GB
        vae           component offload     ram         159.87 MB     0 B      159.87 MB    0.099 s  2.49 GB
    "#]]
    .assert_eq(&plan.table());
    let transformer = plan.component("transformer").expect("planned");
    // The transformer's groups cross 8 times an image: the NVLink card fills with them first, to its memory.
    let on_nvlink = transformer.peer_bytes("cuda:1");
    assert!(on_nvlink > 3 * GB && on_nvlink <= 4 * GB, "{on_nvlink}");
    // PCIe 3.0 x8 (3.1 GB/s) is slower than pageable RAM (15.75 GB/s): it holds nothing.
    assert!(plan.components.iter().all(|c| c.peer_bytes("cuda:2") == 0), "{plan}");
    assert!(
        transformer.why.contains("live on cuda:1 between their uploads, copied at 0.020 s per GB"),
        "{}",
        transformer.why
    );
    let held: u64 = plan.components.iter().map(|c| c.peer_bytes("cuda:1")).sum();
    assert!(held <= 4 * GB, "the peer's budget is shared: {held}");
    assert!(plan.seconds_per_image() < alone.seconds_per_image(), "{plan}\n{alone}");
    // Without peers, nothing changes: no share, the plan as before.
    assert!(alone.components.iter().all(|c| c.peers.is_empty()));
}

#[test]
fn a_slow_peer_beats_reading_the_file_and_frees_ram_for_the_split() {
    // 16 GB of RAM: the copies do not fit, the text encoder and the transformer read their files, and RAM is
    // split over their streamed groups.
    let alone = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 16)).expect("plans");
    let slow = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 16).with_peer(pcie3x8("cuda:1", 24 * GB)))
        .expect("plans");
    let text = slow.component("text_encoder").expect("planned");
    // 0.32 s per GB from the card beats 0.56 s per GB from the disk: the groups RAM does not hold go there.
    assert!(text.peer_bytes("cuda:1") > 0, "{slow}");
    assert!(text.why.contains("live on cuda:1"), "{}", text.why);
    assert!(slow.seconds_per_image() < alone.seconds_per_image(), "{slow}\n{alone}");
    // A fast peer takes the transformer's groups, and the RAM they leave goes to the text encoder's.
    let fast = plan_pipeline(&z_image_turbo(), Preset::Auto, &machine(8, 16).with_peer(nvlink("cuda:1", 4 * GB)))
        .expect("plans");
    let (before, after) =
        (alone.component("text_encoder").expect("planned"), fast.component("text_encoder").expect("planned"));
    assert!(fast.component("transformer").expect("planned").peer_bytes("cuda:1") > 0, "{fast}");
    assert!(after.ram_streamed_bytes > before.ram_streamed_bytes, "{fast}\n{alone}");
    assert!(fast.seconds_per_image() < alone.seconds_per_image());
}

/// A denoiser of five equal 20 MB blocks, called 4 times an image, with no compute (so copies are the whole step
/// and prefetch hides nothing) on a card that keeps none of them resident.
fn denoiser() -> ComponentSpec {
    denoiser_of(BlockLayout::uniform(5, 20 * MB))
}

/// The denoiser with blocks of `blocks` bytes (its 5 MB outside the blocks, as [`denoiser`]'s).
fn denoiser_of(blocks: Vec<u64>) -> ComponentSpec {
    ComponentSpec::new("denoiser", blocks.iter().sum::<u64>() + 5 * MB)
        .with_layout(BlockLayout {
            block_bytes: blocks,
            outside_bytes: 5 * MB,
            largest_leaf_bytes: 5 * MB,
            leaf_count: 20,
            first_leaf_bytes: 5 * MB,
            leaf_bytes: Vec::new(),
        })
        .with_activation(MB)
        .with_cost(0.0, 4)
}

#[test]
fn the_plan_places_groups_over_peers_as_an_exhaustive_search_does_and_prices_each_copy_at_its_link() {
    let time = TimeModel::generic();
    let peers = [PeerDevice::new("fast", 50 * MB, 40e9, 0.0), PeerDevice::new("slow", 30 * MB, 20e9, 0.0)];
    let machine = peers
        .iter()
        .cloned()
        .fold(Machine::new(100 * MB, 100 * MB, HostMemory::new(32 * GB, 28 * GB)).with_time(time), Machine::with_peer);
    let plan = plan_pipeline(
        &[denoiser()],
        settings(&[("resident_budget", "0"), ("pinned_budget", "0"), ("reserve", "1MB")]),
        &machine,
    )
    .expect("plans");
    let planned = plan.component("denoiser").expect("planned");
    assert!(matches!(planned.route, Route::BlockGroupOffload { blocks_per_group: 1, .. }), "{plan}");
    // Every assignment of the five groups to the two peers and pageable RAM, tried one by one.
    let pageable = time.pageable_bytes_per_second();
    let problem = DonorProblem {
        compute_seconds: 0.0,
        groups: (0..5).map(|g| StreamedGroup::new(&format!("block.{g}"), 20 * MB).with_copies(4)).collect(),
        donors: vec![
            Donor::new("fast", DonorKind::Device, 40e9, 0.0).drawing_on(0),
            Donor::new("slow", DonorKind::Device, 20e9, 0.0).drawing_on(1),
            Donor::new("ram", DonorKind::PageableRam, pageable, 0.0),
        ],
        budgets: vec![DonorBudget::new("fast", 50 * MB), DonorBudget::new("slow", 30 * MB)],
    };
    let best = problem.exhaustive().expect("valid").expect("a placement fits");
    for (index, peer) in peers.iter().enumerate() {
        assert_eq!(planned.peer_bytes(&peer.name), best.bytes_from(&problem, index), "{}: {plan}", peer.name);
    }
    assert_eq!(planned.peer_bytes("fast"), 40 * MB);
    assert_eq!(planned.peer_bytes("slow"), 20 * MB);
    // A later step copies 40 MB over the fast link, 20 MB over the slow one and 40 MB from pageable RAM, each
    // copy paying the host link's latency.
    let later = 40e6 / 40e9 + 20e6 / 20e9 + 40e6 / pageable + 5.0 * time.link_latency_seconds;
    let predicted = first_step(&time) + 3.0 * later;
    assert!(
        (planned.seconds_per_image - predicted).abs() < 1e-9,
        "per image {} s, {predicted} s from the links: {plan}",
        planned.seconds_per_image
    );
    assert!(planned.why.contains("2 of its 5 streamed groups (38.15 MB) live on fast between their uploads, copied at 0.025 s per GB; 1 of its 5 streamed groups (19.07 MB) live on slow"), "{}", planned.why);
}

/// Blocks of two sizes and two peers: the search puts a 20 MB and a 30 MB block on each 50 MB peer. A run that
/// filled each peer's budget in call order would put both 20 MB blocks on the first and leave a 30 MB one in RAM;
/// given the sizes, it keeps the search's placement, which the plan reports, and which is the exhaustive search's.
#[test]
fn with_groups_of_two_sizes_the_run_is_given_the_searchs_sizes_on_each_peer() {
    let blocks = vec![20 * MB, 20 * MB, 30 * MB, 30 * MB];
    let spec = denoiser_of(blocks.clone());
    let peers = [PeerDevice::new("one", 50 * MB, 40e9, 0.0), PeerDevice::new("two", 50 * MB, 40e9, 0.0)];
    let machine = peers
        .iter()
        .cloned()
        .fold(Machine::new(100 * MB, 100 * MB, HostMemory::new(32 * GB, 28 * GB)), Machine::with_peer);
    let plan = plan_pipeline(
        std::slice::from_ref(&spec),
        settings(&[("resident_budget", "0"), ("pinned_budget", "0"), ("reserve", "1MB")]),
        &machine,
    )
    .expect("plans");
    let planned = plan.component("denoiser").expect("planned");
    let problem = DonorProblem {
        compute_seconds: 0.0,
        groups: (blocks.iter().enumerate())
            .map(|(g, &bytes)| StreamedGroup::new(&format!("block.{g}"), bytes).with_copies(4))
            .collect(),
        donors: vec![
            Donor::new("one", DonorKind::Device, 40e9, 0.0).drawing_on(0),
            Donor::new("two", DonorKind::Device, 40e9, 0.0).drawing_on(1),
            Donor::new("ram", DonorKind::PageableRam, TimeModel::generic().pageable_bytes_per_second(), 0.0),
        ],
        budgets: vec![DonorBudget::new("one", 50 * MB), DonorBudget::new("two", 50 * MB)],
    };
    let best = problem.exhaustive().expect("valid").expect("a placement fits");
    assert_eq!((best.bytes_from(&problem, 0), best.bytes_from(&problem, 1)), (50 * MB, 50 * MB));
    for share in &planned.peers {
        assert_eq!(share.bytes, 50 * MB, "{plan}");
        let mut sizes = share.group_bytes.clone();
        sizes.sort_unstable();
        assert_eq!(sizes, vec![20 * MB, 30 * MB], "{plan}");
    }
}

/// The first step of the denoiser: the same copies as a later one (a warm process), plus the outside bytes.
fn first_step(time: &TimeModel) -> f64 {
    let pageable = time.pageable_bytes_per_second();
    40e6 / 40e9 + 20e6 / 20e9 + (40e6 + 5e6) / pageable + 6.0 * time.link_latency_seconds
}

#[test]
fn a_peer_with_no_finite_positive_rate_is_refused() {
    let broken = machine(8, 32).with_peer(PeerDevice::new("cuda:1", 4 * GB, 0.0, 0.0));
    let error = plan_pipeline(&z_image_turbo(), Preset::Auto, &broken).expect_err("refused");
    assert!(matches!(error, PlanError::InvalidDonors { .. }), "{error}");
    assert!(
        error.to_string().contains("peer cuda:1 has a link rate of 0 bytes/s; give a finite positive rate"),
        "{error}"
    );
}

#[test]
fn with_each_leafs_size_a_peer_holds_exactly_the_leaves_a_run_keeps() {
    // Two 40 MB blocks of leaves of 20, 10, 10 and 10, 10, 20 MB, streamed at leaf level (a card of 50 MB holds
    // no block pair whole), a fast peer of 35 MB: the search puts 30 MB of leaves there and the run is given their
    // sizes, where six leaves taken as equal (13.33 MB each) would say 26.67 MB.
    let leaves = vec![20 * MB, 10 * MB, 10 * MB, 10 * MB, 10 * MB, 20 * MB];
    let spec = ComponentSpec::new("denoiser", 85 * MB)
        .with_layout(BlockLayout {
            block_bytes: vec![40 * MB, 40 * MB],
            outside_bytes: 5 * MB,
            largest_leaf_bytes: 20 * MB,
            leaf_count: 6,
            first_leaf_bytes: 20 * MB,
            leaf_bytes: leaves,
        })
        .with_activation(MB)
        .with_cost(0.0, 4);
    let machine = Machine::new(50 * MB, 50 * MB, HostMemory::new(32 * GB, 28 * GB)).with_peer(PeerDevice::new(
        "fast",
        35 * MB,
        40e9,
        0.0,
    ));
    let plan =
        plan_pipeline(std::slice::from_ref(&spec), settings(&[("pinned_budget", "0"), ("reserve", "1MB")]), &machine)
            .expect("plans");
    let planned = plan.component("denoiser").expect("planned");
    assert!(matches!(planned.route, Route::LeafGroupOffload { .. }), "{plan}");
    let share = &planned.peers[0];
    assert_eq!(share.bytes, 30 * MB, "{plan}");
    assert_eq!((share.group_bytes.len(), share.group_bytes.iter().sum::<u64>()), (share.groups, 30 * MB));
    // A size per leaf, or none: five sizes for six leaves is refused.
    let mut wrong = spec;
    if let Some(layout) = wrong.layout.as_mut() {
        layout.leaf_bytes.pop();
    }
    let error = wrong.validate().expect_err("refused");
    assert!(error.to_string().contains("its layout lists 5 leaf sizes for 6 leaves"), "{error}");
}

#[test]
fn groups_on_a_peer_are_not_pinned_too() {
    // A denoiser of 12 blocks of 2, 3 and 4 GB called 30 times an image, whose streamed groups the plan pins: a
    // 16 GB peer over NVLink (faster than pinned RAM) takes some, and the pinned budget shrinks to the rest.
    let blocks: Vec<u64> = (0..12).map(|i| (2 + i % 3) * GB).collect();
    let spec = ComponentSpec::new("unet", blocks.iter().sum::<u64>() + GB)
        .with_layout(BlockLayout {
            block_bytes: blocks,
            outside_bytes: GB,
            largest_leaf_bytes: GB / 2,
            leaf_count: 0,
            first_leaf_bytes: 0,
            leaf_bytes: Vec::new(),
        })
        .with_activation(2 * GB)
        .with_cost(4e13, 30);
    let machine = Machine::new(24 * GB, 23 * GB, HostMemory::new(64 * GB, 58 * GB));
    let alone = plan_pipeline(std::slice::from_ref(&spec), Preset::Auto, &machine).expect("plans");
    let with = plan_pipeline(std::slice::from_ref(&spec), Preset::Auto, &machine.with_peer(nvlink("cuda:1", 16 * GB)))
        .expect("plans");
    let (before, after) = (&alone.components[0], &with.components[0]);
    assert_eq!(after.peer_bytes("cuda:1"), 16 * GB, "{with}");
    assert!(before.pinned_bytes > 0, "{alone}");
    assert_eq!(after.pinned_bytes, before.pinned_bytes - 16 * GB, "the pinned groups are the ones left: {with}");
    assert!(after.why.contains("its pinned budget shrinks from"), "{}", after.why);
    assert!(with.seconds_per_image() < alone.seconds_per_image());
}
