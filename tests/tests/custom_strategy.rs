//! The researcher's path end to end: `strategy-lru` depends on `offload-strategy` alone and plugs into the
//! manager, which then evicts the least recently used component instead of the smallest sufficient set.

use std::sync::Arc;

use memory_sim::{ActivationProfile, CardSpec, ComponentProfile, SimCard, VirtualComponent};
use offload_core::ComponentsManager;
use strategy_lru::Lru;

fn component(name: &str, gib: u64, card: &Arc<SimCard>) -> VirtualComponent {
    let profile =
        ComponentProfile { name: name.into(), bytes: gib << 30, activations: ActivationProfile::default(), flops: 0.0 };
    VirtualComponent::new(profile, card.clone())
}

#[test]
fn lru_plugs_into_the_manager() {
    let card = SimCard::new(CardSpec::parse("10GiB").unwrap().with_context_overhead(0));
    let manager = ComponentsManager::new();
    let a = manager.add("a", component("a", 4, &card), None).unwrap();
    let b = manager.add("b", component("b", 3, &card), None).unwrap();
    let c = manager.add("c", component("c", 3, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    manager.set_offload_strategy(Arc::new(Lru)).unwrap();
    for id in [&a, &b, &a, &c] {
        manager.run(id, |v: &mut VirtualComponent| v.call()).unwrap();
    }
    // a (4 GiB), b (3) and c (3) now fill the 10 GiB card. d (3) needs room after b ran again: `Auto` would
    // evict b (the first of the smallest sufficient sets), LRU evicts a, the least recently used.
    let d = manager.add("d", component("d", 3, &card), None).unwrap();
    manager.run(&b, |v: &mut VirtualComponent| v.call()).unwrap();
    manager.run(&d, |v: &mut VirtualComponent| v.call()).unwrap();
    let placement: Vec<(String, bool)> = manager.placement().into_iter().map(|(id, dev)| (id, !dev.is_cpu())).collect();
    assert_eq!(
        placement,
        vec![(a.clone(), false), (b.clone(), true), (c.clone(), true), (d.clone(), true)],
        "{}",
        manager.offload_record()
    );
    assert_eq!(manager.auto_offload().unwrap().strategy, "lru");
}
