//! The device module's unit tests.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use burn::tensor::Device;
use offload_core::device::ReadingUnavailable;
use offload_core::{ComponentError, DeviceLedger, DeviceName};
use parking_lot::Mutex;

use super::call::*;
use super::cap::*;
use super::failure::*;
use super::open::*;
use super::pool::*;
use crate::error::Error;

fn name() -> DeviceName {
    DeviceName::parse("wgpu:0").expect("a device name")
}

#[test]
fn availability_is_free_plus_cache_with_a_driver_and_total_less_in_use_without() {
    let with_driver = PoolSnapshot {
        in_use: 600,
        padding: 40,
        reserved: 1_000,
        total: 10_000,
        driver_free: Some(7_000),
        ..PoolSnapshot::default()
    };
    assert_eq!(with_driver.cache(), 360);
    assert_eq!(with_driver.available(), 7_360);
    // 10,000 − 7,000 = 3,000 used on the device, 1,000 of it the pool's pages: 2,000 is the context and others.
    assert_eq!(with_driver.outside_pool(), 2_000);
    assert_eq!(with_driver.charged(), 2_640);
    let without = PoolSnapshot { driver_free: None, ..with_driver };
    assert_eq!(without.available(), 9_360);
    assert_eq!(without.outside_pool(), 0);
    assert_eq!(without.charged(), 640);
    // A cap counts the context, the others and the padding, not the reusable cache.
    assert_eq!(with_driver.available_under(5_000), 2_360);
    assert_eq!(with_driver.available_under(100_000), 7_360);
    assert_eq!(with_driver.available_under(2_000), 0);
}

/// The runtime's texts as cubecl 0.11.3 and burn 0.22.1 format them (`ServerError`, `IoError`, `LaunchError`,
/// `ExecutionError`, burn's `into_data` panic), one file each: `oom-*` are out-of-memory, `poisoned-*` a poisoned
/// device, `unallocated-*` memory never allocated, `other-*` anything else. Most were assembled from the runtimes'
/// format strings. Two were captured from a failing run on lavapipe, made to run out under an address-space
/// limit (`docs/devices.md`): the panic of cubecl's runner thread (`oom-wgpu-panic.txt`) and what the read of
/// the memory it was allocating returned (`unallocated-wgpu-oom-read.txt`).
fn fixtures() -> Vec<(String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/runtime-errors");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .expect("the fixtures directory")
        .map(|entry| {
            let path = entry.expect("an entry").path();
            let name = path.file_name().expect("a name").to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&path).expect("a fixture"))
        })
        .collect();
    files.sort();
    files
}

#[test]
fn each_runtime_fixture_is_classified_by_its_first_lines_alone() {
    let files = fixtures();
    assert!(files.len() >= 12, "{} fixtures", files.len());
    for (name, text) in &files {
        let failure = RuntimeFailure::of(text);
        let expected = name.split('-').next().expect("a prefix");
        let got = match failure {
            RuntimeFailure::OutOfMemory { .. } => "oom",
            RuntimeFailure::Poisoned => "poisoned",
            RuntimeFailure::Unallocated => "unallocated",
            RuntimeFailure::Other => "other",
        };
        assert_eq!(got, expected, "{name}: {failure:?}");
    }
    let sized = |file: &str| {
        let text = &files.iter().find(|(name, _)| name == file).expect("the fixture").1;
        out_of_memory_in(text)
    };
    assert_eq!(sized("oom-io-vulkan.txt"), Some(Some(68_719_476_736)));
    assert_eq!(sized("oom-io-cuda.txt"), Some(Some(268_435_456)));
    assert_eq!(sized("oom-unwritten-root.txt"), Some(Some(4_194_304)));
    assert_eq!(sized("oom-read-panic.txt"), Some(Some(1024)));
    assert_eq!(sized("oom-launch.txt"), Some(None));
    assert_eq!(sized("oom-wgpu-panic.txt"), Some(None));
    assert_eq!(sized("oom-page-sizes-exhausted.txt"), Some(Some(2_097_152)));
    assert_eq!(sized("oom-page-sizes-read-panic.txt"), Some(Some(512)));
}

#[test]
fn memory_never_allocated_is_an_out_of_memory_only_where_the_runtime_recorded_one() {
    let text = "An error happened during execution\nCaused by:\n  Several failures at once\nCaused by:\n  The \
                bytes were never written (failure #32, still claiming 1 buffer(s))\nCaused by:\n  An IO error \
                happened\nCaused by:\n  couldn't find resource for that handle: Memory location was never \
                initialized\nNo backtrace available";
    assert_eq!(RuntimeFailure::of(text), RuntimeFailure::Unallocated);
    assert_eq!(out_of_memory_in(text), None, "the words alone are no out-of-memory");
    // No runtime here recorded an out-of-memory panic (the flex build has no wgpu runner): a device error.
    if !cfg!(feature = "wgpu") {
        let error = classify(&name(), "run", text, false, None);
        assert!(matches!(error, ComponentError::Device { .. }), "{error:?}");
    }
}

#[test]
fn the_default_wgpu_builds_out_of_memory_panic_is_caught_and_retryable_and_other_wgpu_panics_are_not() {
    // What cubecl raises again in the caller for wgpu's out-of-memory on its runner thread.
    let caught = catch_device_panic(|| -> u32 { std::panic::panic_any(WGPU_OUT_OF_MEMORY.to_string()) });
    let error = caught.expect_err("the runtime's panic is caught").with_device(&name(), "upload", None);
    assert!(matches!(error, ComponentError::OutOfMemory { requested: 0, available: 0, .. }), "{error:?}");
    // A validation error is a bug in the runtime's use, not a device failure: it goes on unwinding.
    let unwound = std::panic::catch_unwind(|| {
        catch_device_panic(|| -> u32 { panic!("wgpu error: Validation Error\n\nCaused by:\n  Out of Memory") })
    });
    assert!(unwound.is_err(), "a wgpu validation panic was swallowed");
}

#[test]
fn every_poisoned_text_of_cubecl_is_poisoned_on_the_panic_path_too() {
    for text in [
        "The device is poisoned: Lost: the GPU went away\nBacktrace:\n   0: x",
        "A launch error happened\nCaused by:\n  A compilation error happened during launch\nCaused by:\n  \
         The device is poisoned, the kernel could not be loaded\nCaused by:\n  Lost",
    ] {
        // The panic path passes no poisoned flag: the words alone decide.
        let caught = catch_device_panic(|| -> u32 { std::panic::panic_any(text.to_string()) });
        let error = caught.expect_err("the runtime's panic is caught").with_device(&name(), "run", None);
        let inner = match &error {
            ComponentError::Other(inner) => inner.downcast_ref::<Error>(),
            _ => None,
        };
        assert!(matches!(inner, Some(Error::DevicePoisoned { .. })), "{text}: {error:?}");
    }
    assert_eq!(RuntimeFailure::of("The device is poisoned by my model"), RuntimeFailure::Other);
}

#[test]
fn out_of_memory_is_recognised_in_the_runtimes_words_and_nothing_else_is() {
    assert_eq!(out_of_memory_in("out of device memory allocating 4096 bytes\nbacktrace"), Some(Some(4096)));
    assert_eq!(out_of_memory_in("An out-of-memory error happened during launch\nCaused by: x"), Some(None));
    // A driver's or a model's words are not the runtime's out-of-memory.
    assert_eq!(out_of_memory_in("CUDA_ERROR_OUT_OF_MEMORY: out of memory"), None);
    assert_eq!(out_of_memory_in("my model ran out of memory"), None);
    assert_eq!(out_of_memory_in("out of device memory allocating many bytes"), None);
    assert_eq!(out_of_memory_in("A compilation error happened during launch"), None);
    assert_eq!(out_of_memory_in("The device is poisoned"), None);
    // A wrapper without the line that names what it wraps is not read further.
    assert_eq!(out_of_memory_in("An IO error happened\n  out of device memory allocating 4 bytes"), None);
}

#[test]
fn a_poisoned_device_is_its_own_error_and_never_an_out_of_memory() {
    let error = classify(&name(), "run", "The device is poisoned\nCaused by:\n  illegal address\nbt", false, None);
    assert!(!error.is_out_of_memory());
    match &error {
        ComponentError::Other(inner) => {
            let inner = inner.downcast_ref::<Error>().expect("group-offload's error");
            assert!(matches!(inner, Error::DevicePoisoned { operation: "run", .. }), "{inner:?}");
            assert!(inner.to_string().contains("restart the process"), "{inner}");
        }
        other => panic!("expected the poisoned device, got {other:?}"),
    }
    // burn's own flag decides even where the words would say out-of-memory.
    let flagged = classify(&name(), "run", "out of device memory allocating 77 bytes", true, None);
    assert!(!flagged.is_out_of_memory(), "{flagged:?}");
}

#[test]
fn a_failure_that_is_not_memory_is_a_device_error_never_an_out_of_memory() {
    let text = "An IO error happened\nCaused by:\n  can't allocate buffer of size: 99\nbt";
    let error = classify(&name(), "run", text, false, None);
    match &error {
        ComponentError::Device { device, message } => {
            assert_eq!(device.as_str(), "wgpu:0");
            assert!(message.starts_with("during run: "), "{message}");
            assert!(message.contains("can't allocate buffer") && !message.contains("bt"), "{message}");
        }
        other => panic!("expected a device error, got {other:?}"),
    }
    assert!(!error.is_out_of_memory());
    let oom = classify(&name(), "upload", "out of device memory allocating 77 bytes", false, None);
    assert!(matches!(oom, ComponentError::OutOfMemory { requested: 77, available: 0, .. }), "{oom:?}");
}

#[test]
fn a_runtime_panic_is_caught_with_its_message_and_a_bug_is_not() {
    let caught = catch_device_panic(|| -> u32 {
        panic!(
            "{BURN_READ_PANIC}An error happened during execution\nCaused by:\n  An IO error happened\nCaused by:\n  out of device memory allocating 12 bytes"
        )
    });
    let error = caught.expect_err("the panic is caught").with_device(&name(), "run", None);
    assert!(matches!(error, ComponentError::OutOfMemory { requested: 12, .. }), "{error:?}");
    let caught = catch_device_panic(|| -> u32 { panic!("An error happened during execution\nCaused by:\n  x") });
    let error = caught.expect_err("the panic is caught").with_device(&name(), "run", None);
    assert!(matches!(error, ComponentError::Device { .. }), "{error:?}");
    assert_eq!(catch_device_panic(|| 5).expect("no panic"), 5);
    // A bug is not a device failure, whatever its words: it goes on unwinding.
    for bug in ["index out of bounds", "my model is out of memory", "oops: out of device memory allocating 1 bytes"] {
        let unwound = std::panic::catch_unwind(|| catch_device_panic(|| -> u32 { panic!("{bug}") }));
        assert!(unwound.is_err(), "the bug's panic {bug:?} was not swallowed");
    }
}

#[test]
fn a_users_forward_that_panics_is_never_caught_and_its_call_is_closed() {
    struct Calls(Mutex<(u32, u32)>);
    impl DeviceLedger for Calls {
        fn allocate(&self, _bytes: u64) -> std::result::Result<(), ComponentError> {
            Ok(())
        }
        fn free(&self, _bytes: u64) {}
        fn begin_call(&self, _estimate: u64) -> std::result::Result<(), ComponentError> {
            self.0.lock().0 += 1;
            Ok(())
        }
        fn end_call(&self, _estimate: u64) -> std::result::Result<(), ComponentError> {
            self.0.lock().1 += 1;
            Ok(())
        }
    }
    let ledger = Arc::new(Calls(Mutex::new((0, 0))));
    let device = Device::flex();
    let on = crate::OffloadDevice::on_device(device.clone(), DeviceName::cpu(), ledger.clone(), None);
    // Even a panic in the runtime's own words is the forward's: run_call does not catch it.
    let unwound = std::panic::catch_unwind(AssertUnwindSafe(|| {
        run_call(&on, &device, 10, || -> std::result::Result<(), ComponentError> {
            panic!("out of device memory allocating 12 bytes")
        })
    }));
    assert!(unwound.is_err(), "the forward's panic reached the caller");
    assert_eq!(*ledger.0.lock(), (1, 1), "begin_call and end_call matched");
    let ran = run_call(&on, &device, 10, || Ok(()));
    assert!(ran.is_ok());
    assert_eq!(*ledger.0.lock(), (2, 2));
}

#[test]
fn the_cap_counts_what_is_outside_the_pool_the_pools_pages_and_what_it_does_not_show_yet() {
    let now = PoolSnapshot {
        in_use: 600,
        padding: 40,
        reserved: 1_000,
        total: 10_000,
        driver_free: Some(7_000),
        ..PoolSnapshot::default()
    };
    let empty = Account::default();
    // 2,000 outside the pool, 1,000 of pages in it (640 of them allocated: the rest a card must hold too).
    assert_eq!(free_under(5_000, &now, &empty), 2_000);
    // A reservation the pool does not show yet counts on top of its pages.
    let mut account = Account::default();
    account.settle(&now);
    account.place(std::thread::current().id(), 640);
    assert_eq!(free_under(5_000, &now, &account), 1_360);
    // The account holds more than the pool and its pending reservations (a misattributed growth): it counts.
    let held = Account { placed: 2_500, ..Account::default() };
    assert_eq!(free_under(5_000, &now, &held), 500);
    // Never more than the device itself can give.
    assert_eq!(free_under(100_000, &now, &empty), 7_360);
    assert_eq!(free_under(1_000, &now, &empty), 0);
}

#[test]
fn a_prefetch_cannot_pass_the_cap_while_a_calls_estimate_is_reserved_but_not_yet_allocated() {
    // 600 B of weights placed and on the pool, beside 400 B of pages nobody reserved (an earlier call's outputs).
    let account = Mutex::new(Account { placed: 600, ..Account::default() });
    let pool = PoolSnapshot {
        in_use: 1_000,
        padding: 0,
        reserved: 1_000,
        total: 1 << 20,
        driver_free: None,
        ..PoolSnapshot::default()
    };
    let main = std::thread::current().id();
    // The main thread's call reserves its 1,000 B estimate under a 2,200 B cap; nothing of it is allocated yet.
    reserve_in(&account, 2_200, 1_000, || Ok(pool), || (), |a| a.begin_call(main, 1_000))
        .expect("the call's estimate fits");
    // A prefetch of 500 B now would put 2,500 B on a 2,200 B card once the call allocates.
    let worker = std::thread::spawn(|| std::thread::current().id()).join().expect("a thread id");
    let refused = reserve_in(&account, 2_200, 500, || Ok(pool), || (), |a| a.place(worker, 500));
    assert!(matches!(refused, Err(Refusal::Full { requested: 500, free: 200 })), "{refused:?}");
    // The call allocates its activations: the pool shows them, and they are charged once, not twice.
    let during = PoolSnapshot { in_use: 2_000, reserved: 2_000, ..pool };
    let refused = reserve_in(&account, 2_200, 500, || Ok(during), || (), |a| a.place(worker, 500));
    assert!(matches!(refused, Err(Refusal::Full { requested: 500, free: 200 })), "{refused:?}");
    assert_eq!(account.lock().pending(), 0, "the call's estimate is on the pool");
    // The call ends and frees its activations (cache now): the prefetch is granted once the cache is released.
    assert_eq!(account.lock().end_call(main), 1_000);
    let after = PoolSnapshot { in_use: 1_000, reserved: 2_000, ..pool };
    let released = std::cell::Cell::new(false);
    let read = || Ok(if released.get() { pool } else { after });
    reserve_in(&account, 2_200, 500, read, || released.set(true), |a| a.place(worker, 500)).expect("granted");
    assert!(released.get());
    let account = account.lock();
    assert_eq!((account.reserved(), account.pending()), (1_100, 500), "the upload is pending until the pool grows");
}

#[test]
fn reservations_are_pending_until_the_pool_grows_by_them_or_their_thread_goes_on() {
    let (main, worker) =
        (std::thread::current().id(), std::thread::spawn(|| std::thread::current().id()).join().expect("an id"));
    let mut account = Account::default();
    let at = |reserved: u64| PoolSnapshot {
        in_use: reserved,
        padding: 0,
        reserved,
        total: 1 << 20,
        driver_free: None,
        ..PoolSnapshot::default()
    };
    account.settle(&at(1_000));
    account.place(worker, 300);
    account.begin_call(main, 400);
    assert_eq!((account.reserved(), account.pending()), (700, 700));
    // Charged: the pool, and what it does not show yet, on top of what is outside it (nothing here).
    assert_eq!(account.charged(&at(1_000)), 1_700);
    // The pool grows by 200: the oldest reservation (the upload) is credited first.
    account.settle(&at(1_200));
    assert_eq!(
        account.pending,
        vec![Pending { thread: worker, call: false, pages: 100 }, Pending { thread: main, call: true, pages: 400 }]
    );
    // A shrink (the cache released) allocates nothing; the next growth counts from there.
    account.settle(&at(900));
    account.settle(&at(1_000));
    assert_eq!(account.pending(), 400);
    // The worker goes on (its next reservation): its last upload is on the device.
    account.place(worker, 50);
    assert_eq!(
        account.pending,
        vec![Pending { thread: main, call: true, pages: 400 }, Pending { thread: worker, call: false, pages: 50 }]
    );
    // The call ends: what it did not allocate is no longer promised.
    assert_eq!(account.end_call(main), 400);
    assert_eq!(account.pending(), 50);
    // Never less than the reservations: growth credited to them that the pool then gave back.
    account.settle(&at(1_050));
    assert_eq!((account.reserved(), account.pending()), (350, 0));
    assert_eq!(account.charged(&at(100)), 350);
    // A failed upload is given back on its thread: nothing of it stays pending.
    account.place(worker, 70);
    account.unplace(worker, 70);
    assert_eq!((account.reserved(), account.pending()), (350, 0));
}

#[test]
fn growth_goes_to_the_uploads_first_so_a_calls_estimate_outlives_the_workers_next_upload() {
    let (main, worker) =
        (std::thread::current().id(), std::thread::spawn(|| std::thread::current().id()).join().expect("an id"));
    let at = |reserved: u64| PoolSnapshot { in_use: reserved, reserved, total: 1 << 20, ..PoolSnapshot::default() };
    let mut account = Account::default();
    account.settle(&at(1_000));
    // The call reserves its estimate before the worker reserves an upload: the call's is the older reservation.
    account.begin_call(main, 400);
    account.place(worker, 300);
    // The upload lands (the pool grows by its 300 B) while the call has allocated nothing: the upload is made.
    account.settle(&at(1_300));
    assert_eq!(account.pending, vec![Pending { thread: main, call: true, pages: 400 }]);
    // The worker goes on to its next upload: the call's estimate is still pending whole (credited to the call, the
    // landing would have left 100 B of it, and the worker's next grant would have taken the other 300 B).
    account.place(worker, 300);
    assert_eq!(account.pending(), 700);
    // Growth beyond the pending uploads is the call's.
    account.settle(&at(1_900));
    assert_eq!(account.pending, vec![Pending { thread: main, call: true, pages: 100 }]);
}

#[test]
fn a_request_the_pages_refuse_is_granted_once_the_cache_is_released_and_only_then() {
    let account = Mutex::new(Account::default());
    // 3,000 of pages, 1,000 of them cache; a cap of 4,000 leaves 1,000, and 1,500 are asked.
    let before = PoolSnapshot {
        in_use: 2_000,
        padding: 0,
        reserved: 3_000,
        total: 1 << 20,
        driver_free: None,
        ..PoolSnapshot::default()
    };
    let after = PoolSnapshot { reserved: 2_000, ..before };
    let released = std::cell::Cell::new(false);
    let read = || Ok(if released.get() { after } else { before });
    reserve_in(&account, 4_000, 1_500, read, || released.set(true), |a| a.placed += 1_500).expect("granted");
    assert!(released.get(), "the cache was released before the request was granted");
    assert_eq!(account.lock().placed, 1_500);
    // A request that fits is granted without a release; one that the released pool still refuses is refused.
    let (account, released) = (Mutex::new(Account::default()), std::cell::Cell::new(false));
    let read = || Ok(after);
    reserve_in(&account, 4_000, 100, read, || released.set(true), |a| a.placed += 100).expect("granted");
    assert!(!released.get(), "nothing was released for a request that fitted");
    let refused = reserve_in(&account, 4_000, 2_500, read, || (), |a| a.placed += 2_500);
    assert!(matches!(refused, Err(Refusal::Full { requested: 2_500, free: 2_000 })), "{refused:?}");
}

#[test]
fn two_threads_never_both_pass_on_the_same_free_bytes() {
    // Eight threads ask at once for 600 B to 767 B each of a 4,096 B cap: at least 4,800 B together, so every
    // round some are refused, whatever the scheduler does. Each holds what it was granted until every thread has
    // asked (a barrier), then gives it back before the next round.
    const CAPACITY: u64 = 16 * 256;
    const THREADS: usize = 8;
    let account = Arc::new(Mutex::new(Account::default()));
    let barrier = Arc::new(std::sync::Barrier::new(THREADS));
    let empty = PoolSnapshot {
        in_use: 0,
        padding: 0,
        reserved: 0,
        total: 1 << 30,
        driver_free: None,
        ..PoolSnapshot::default()
    };
    let threads: Vec<_> = (0..THREADS as u64)
        .map(|thread| {
            let (account, barrier) = (account.clone(), barrier.clone());
            std::thread::spawn(move || {
                let (mut granted, mut refused) = (0u64, 0u64);
                for round in 0..300u64 {
                    let pages = PageRule::CUBECL.pages(600 + (round * 7 + thread * 13) % 168);
                    // The reading is slow, so a check without the lock would let others in between.
                    let read = || {
                        std::thread::yield_now();
                        Ok(empty)
                    };
                    let held = reserve_in(&account, CAPACITY, pages, read, || (), |a| a.placed += pages).is_ok();
                    if held {
                        granted += 1;
                        assert!(account.lock().reserved() <= CAPACITY);
                    } else {
                        refused += 1;
                    }
                    barrier.wait();
                    if held {
                        account.lock().placed -= pages;
                    }
                    barrier.wait();
                }
                (granted, refused)
            })
        })
        .collect();
    let counts: Vec<(u64, u64)> = threads.into_iter().map(|t| t.join().expect("a thread")).collect();
    let (granted, refused) = counts.iter().fold((0, 0), |(g, r), (a, b)| (g + a, r + b));
    let account = account.lock();
    assert!(granted > 0 && refused > 0, "granted {granted}, refused {refused}");
    assert_eq!(account.placed, 0);
    assert!(account.high_water <= CAPACITY, "the account held {} of {CAPACITY}", account.high_water);
    let refused = reserve_in(&Mutex::new(Account::default()), 100, 101, || Ok(empty), || (), |_| {});
    assert!(matches!(refused, Err(Refusal::Full { requested: 101, free: 100 })), "{refused:?}");
    let unknown = ReadingUnavailable { device: DeviceName::cpu(), message: "no answer".into() };
    let refused = reserve_in(&Mutex::new(Account::default()), 100, 1, || Err(unknown.clone()), || (), |_| {});
    assert!(matches!(refused, Err(Refusal::Unreadable(_))), "{refused:?}");
}

#[test]
fn the_page_rule_rounds_each_allocation_up_on_its_own() {
    assert_eq!(PageRule::Bytes.pages(1001), 1001);
    assert_eq!(PageRule::CUBECL.pages(0), 0);
    assert_eq!(PageRule::CUBECL.pages(1), 256);
    assert_eq!(PageRule::CUBECL.pages(256), 256);
    assert_eq!(PageRule::CUBECL.pages(257), 512);
    assert_eq!(PageRule::CUBECL.pages_of(&[1, 1, 300]), 1024);
    assert_eq!(PageRule::RoundUp { granularity: 0 }.pages(7), 7);
    assert_eq!(PageRule::CUBECL.pages(u64::MAX), u64::MAX);
}

#[test]
fn devices_are_opened_by_kind_and_unknown_kinds_are_typed_errors() {
    assert!(open_device(&DeviceName::cpu()).is_ok());
    let error = open_device(&DeviceName::parse("tpu:0").expect("a name")).expect_err("no such backend");
    assert!(matches!(error, Error::UnknownDevice { .. }), "{error:?}");
    #[cfg(not(feature = "cuda"))]
    {
        let error = open_device(&DeviceName::parse("cuda:0").expect("a name")).expect_err("not built");
        assert!(matches!(error, Error::DeviceNotBuilt { feature: "cuda", .. }), "{error:?}");
        assert!(error.to_string().contains("--features cuda"), "{error}");
    }
    #[cfg(not(feature = "wgpu"))]
    {
        let error = open_device(&name()).expect_err("not built");
        assert!(matches!(error, Error::DeviceNotBuilt { feature: "wgpu", .. }), "{error:?}");
        assert!(error.to_string().contains("mesa-vulkan-drivers"), "{error}");
    }
}

#[test]
fn a_cuda_drivers_failure_is_named_as_it_is_and_never_as_a_missing_driver() {
    let seven = DeviceName::parse("cuda:7").expect("a name");
    let words = Some("invalid device ordinal");
    // A wrong index: the driver's count and its words.
    let error = cuda_failure(&seven, "open", "CUDA_ERROR_INVALID_DEVICE", words, || Ok(1));
    assert_eq!(
        error.to_string(),
        "cannot open cuda:7: there is no such CUDA device: the driver lists 1, cuda:0 (CUDA_ERROR_INVALID_DEVICE: \
         invalid device ordinal); pick one of the devices `nvidia-smi -L` lists (cuda:0 is the first), or another \
         --device"
    );
    let error = cuda_failure(&seven, "open", "CUDA_ERROR_INVALID_DEVICE", words, || Ok(4));
    assert!(error.to_string().contains("the driver lists 4, cuda:0 to cuda:3"), "{error}");
    let error = cuda_failure(&seven, "open", "CUDA_ERROR_INVALID_DEVICE", None, || {
        Err("CUDA_ERROR_NOT_INITIALIZED (initialization error)".into())
    });
    assert!(matches!(error, Error::NoSuchDevice { .. }), "{error:?}");
    assert!(
        error.to_string().contains(
            "the driver says CUDA_ERROR_INVALID_DEVICE, and could not count its devices \
             (CUDA_ERROR_NOT_INITIALIZED (initialization error))"
        ),
        "{error}"
    );
    let zero = DeviceName::parse("cuda:0").expect("a name");
    let error = cuda_failure(&zero, "open", "CUDA_ERROR_NO_DEVICE", Some("no CUDA-capable device is detected"), || {
        panic!("the count is asked only for a wrong index")
    });
    assert!(error.to_string().contains("the driver sees no CUDA device (CUDA_ERROR_NO_DEVICE: no CUDA-capable"));
    // Anything else is the driver's failure, in its words.
    let error = cuda_failure(&zero, "open", "CUDA_ERROR_NOT_INITIALIZED", Some("initialization error"), || Ok(1));
    assert_eq!(
        error.to_string(),
        "the CUDA driver failed to open cuda:0: it returned CUDA_ERROR_NOT_INITIALIZED (initialization error); \
         check that `nvidia-smi` lists the card and the driver's messages (`dmesg`), or pick another --device"
    );
    let error = cuda_failure(&zero, "open", "CUDA_ERROR_UNKNOWN", None, || Ok(1));
    assert!(error.to_string().contains("CUDA_ERROR_UNKNOWN (the driver gave no description)"), "{error}");
    for error in [
        cuda_failure(&seven, "open", "CUDA_ERROR_INVALID_DEVICE", words, || Ok(1)),
        cuda_failure(&zero, "open", "CUDA_ERROR_OPERATING_SYSTEM", None, || Ok(1)),
    ] {
        assert!(!matches!(error, Error::NoDriver { .. }) && !error.to_string().contains("install"), "{error}");
    }
}

/// The names the classification reads are cudarc's codes as they print.
#[cfg(feature = "cuda")]
#[test]
fn cudarcs_codes_print_as_the_names_the_classification_reads() {
    use cudarc::driver::{DriverError, sys::CUresult};
    for (code, name) in [
        (CUresult::CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"),
        (CUresult::CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"),
    ] {
        assert_eq!(format!("{:?}", DriverError(code).0), name);
    }
}

#[test]
fn a_failed_free_memory_call_is_an_unknown_reading_in_the_drivers_words_never_an_empty_device() {
    let failure =
        DriverFailure { code: "CUDA_ERROR_ILLEGAL_ADDRESS".into(), words: Some("an illegal memory access".into()) };
    let unknown = failure.unread(&DeviceName::parse("cuda:0").expect("a name"));
    assert_eq!(
        unknown.message,
        "the CUDA driver's free-memory call (cuMemGetInfo) returned CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory \
         access), so what other processes hold on the device is unknown"
    );
}

#[test]
fn the_cpu_backend_has_no_pool_to_read() {
    let error = PoolReadings::open(Device::flex(), DeviceName::cpu(), Some(1 << 30)).expect_err("flex has no pool");
    assert!(matches!(error, Error::NoPoolReadings { .. }), "{error:?}");
}
