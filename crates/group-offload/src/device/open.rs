//! Opening a device by its name: the CPU backend, CUDA through its driver, wgpu with its one runtime per
//! process; what a failed open says.

use burn::tensor::Device;
use offload_core::{ComponentError, DeviceName};

#[cfg(feature = "wgpu")]
use super::failure::{catch_device_panic, record_wgpu_out_of_memory_panics};
#[cfg(feature = "wgpu")]
use super::probe::check_device;
use crate::error::{Error, Result};
#[cfg(feature = "wgpu")]
use burn::tensor::Tensor;
#[cfg(feature = "cuda")]
use std::sync::Arc;

/// Opens the burn device `name` names: `cpu` is burn's `flex` CPU backend, `cuda:N` a CUDA device (feature
/// `cuda`), `wgpu:0` (or `vulkan:0`) the default adapter of burn's wgpu backend (feature `wgpu`; on a CPU-only
/// Linux machine that is Mesa's lavapipe Vulkan driver) and `wgpu:N` the N-th adapter in burn's list of the
/// machine's wgpu adapters, each its own runtime (a second GPU: `wgpu:1` where the default is listed first).
///
/// Fails with [`Error::DeviceNotBuilt`] for a kind this build has no backend for, [`Error::NoDriver`] when the
/// runtime finds no device (no Vulkan driver installed, say), and [`Error::UnknownDevice`] for any other kind.
pub fn open_device(name: &DeviceName) -> Result<Device> {
    open_device_with(name, PagePolicy::Adaptive)
}

/// How a runtime's memory pool takes pages from the device, where the runtime lets it be chosen (wgpu; CUDA
/// keeps its default).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PagePolicy {
    /// cubecl's default: small allocations share pages, larger ones are carved from pages sized to the largest
    /// allocation so far (fast; on a small workload the pages are mostly cache).
    #[default]
    Adaptive,
    /// One page per allocation, sized to it (measured on lavapipe: reserved within 12 KB of the bytes in use), so
    /// the pool's pages follow what a workload allocates: what a cap on the pages ([`CappedDevice`](super::CappedDevice)) wants.
    Exclusive,
}

/// [`open_device`] with a page policy for the runtime's pool. A runtime is set up once per process: the first
/// open of a wgpu device's name chooses its policy, later opens share it ([`describe_device`] says which).
pub fn open_device_with(name: &DeviceName, pages: PagePolicy) -> Result<Device> {
    match name.kind() {
        "cpu" => Ok(Device::flex()),
        "cuda" => open_cuda(name),
        "wgpu" | "vulkan" => open_wgpu(name, pages),
        other => Err(Error::UnknownDevice { kind: other.to_string() }),
    }
}

/// The index of an indexed device name (`1` for `cuda:1`), 0 for the host.
pub fn device_index(name: &DeviceName) -> u32 {
    name.as_str().split(':').nth(1).and_then(|index| index.parse().ok()).unwrap_or(0)
}

/// The words cudarc panics with when it cannot load NVIDIA's driver library (`cudarc` 0.19, `lib.rs`,
/// `panic_no_lib_found`).
#[cfg(feature = "cuda")]
pub(super) const CUDA_NO_LIBRARY: &str = "Unable to dynamically load the \"cuda\" shared library";

/// Opens a CUDA context on device `index` through cudarc, as burn's runtime will: a machine without NVIDIA's
/// driver library makes cudarc panic while it loads `libcuda` (there is no safe call that asks first), so that
/// one panic, recognised by cudarc's own words, becomes [`Error::NoDriver`] naming the driver; any other panic
/// goes on unwinding. A driver that loads but fails is named as it is ([`cuda_failure`]): a wrong index is
/// [`Error::NoSuchDevice`] with the number of devices there are, anything else [`Error::DriverFailed`] with the
/// driver's words.
#[cfg(feature = "cuda")]
pub(super) fn cuda_context(name: &DeviceName) -> Result<Arc<cudarc::driver::CudaContext>> {
    let no_driver = |message: String| Error::NoDriver {
        device: name.to_string(),
        message,
        fix: "install NVIDIA's driver (it provides libcuda.so.1; on Debian the `nvidia-driver` package, or the \
              driver from nvidia.com), check that `nvidia-smi` lists the card and that LD_LIBRARY_PATH reaches \
              libcuda, or pick another --device (cpu, wgpu)"
            .into(),
    };
    let index = device_index(name) as usize;
    // The default hook would print cudarc's panic and a backtrace above the typed error (seen with the CUDA
    // release build of gpu_check on a machine without the driver): silence it for this one call.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let opened = std::panic::catch_unwind(|| cudarc::driver::CudaContext::new(index));
    std::panic::set_hook(hook);
    let opened = opened.map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_string()))
            .unwrap_or_default();
        if !message.starts_with(CUDA_NO_LIBRARY) {
            std::panic::resume_unwind(payload);
        }
        no_driver(message)
    })?;
    opened.map_err(|error| {
        let (code, words) = driver_words(&error);
        cuda_failure(name, "open", &code, words.as_deref(), || {
            cudarc::driver::CudaContext::device_count().map(|count| count.max(0) as u32).map_err(|error| {
                let (code, words) = driver_words(&error);
                format!("{code} ({})", words.as_deref().unwrap_or(NO_WORDS))
            })
        })
    })
}

/// A CUDA driver error's code by name (`CUDA_ERROR_INVALID_DEVICE`, cudarc's `CUresult` as it prints) and the
/// driver's own words for it (`cuGetErrorString`), where the driver gives them. Only called with an error the
/// driver returned, so its library is loaded and asking it for the words cannot panic.
#[cfg(feature = "cuda")]
pub(super) fn driver_words(error: &cudarc::driver::DriverError) -> (String, Option<String>) {
    let words = error.error_string().ok().map(|words| words.to_string_lossy().into_owned());
    (format!("{:?}", error.0), words)
}

/// What [`Error::DriverFailed`] says where the driver gave no words for its code.
pub(super) const NO_WORDS: &str = "the driver gave no description";

/// The typed error of a CUDA driver call on `name` (`operation`: what was asked) that returned `code` (its name, as
/// cudarc prints a `CUresult`) with the driver's `words` for it. A wrong index (`CUDA_ERROR_INVALID_DEVICE`) and a
/// driver that sees no device (`CUDA_ERROR_NO_DEVICE`) are [`Error::NoSuchDevice`], saying how many devices there
/// are (`count`, asked only then: the driver's count, or its own words where it could not count); anything else is
/// [`Error::DriverFailed`] with the code and the words. Never [`Error::NoDriver`]: the driver answered.
pub fn cuda_failure(
    name: &DeviceName,
    operation: &'static str,
    code: &str,
    words: Option<&str>,
    count: impl FnOnce() -> std::result::Result<u32, String>,
) -> Error {
    let said = |code: &str| match words {
        Some(words) => format!("{code}: {words}"),
        None => code.to_string(),
    };
    match code {
        "CUDA_ERROR_INVALID_DEVICE" => {
            let reason = match count() {
                Ok(0) => format!("the driver lists no CUDA device ({})", said(code)),
                Ok(1) => format!("there is no such CUDA device: the driver lists 1, cuda:0 ({})", said(code)),
                Ok(n) => format!(
                    "there is no such CUDA device: the driver lists {n}, cuda:0 to cuda:{} ({})",
                    n - 1,
                    said(code)
                ),
                Err(why) => {
                    format!("the driver says {}, and could not count its devices ({why})", said(code))
                }
            };
            Error::NoSuchDevice { device: name.to_string(), reason }
        }
        "CUDA_ERROR_NO_DEVICE" => Error::NoSuchDevice {
            device: name.to_string(),
            reason: format!("the driver sees no CUDA device ({}; CUDA_VISIBLE_DEVICES can hide them)", said(code)),
        },
        _ => Error::DriverFailed {
            device: name.to_string(),
            operation,
            code: code.to_string(),
            words: words.unwrap_or(NO_WORDS).to_string(),
        },
    }
}

#[cfg(feature = "cuda")]
pub(super) fn open_cuda(name: &DeviceName) -> Result<Device> {
    // burn's CUDA runtime panics on first use when there is no driver; ask the driver first, so a machine
    // without one gets a typed error.
    cuda_context(name)?;
    Ok(Device::cuda(device_index(name)))
}

#[cfg(not(feature = "cuda"))]
pub(super) fn open_cuda(name: &DeviceName) -> Result<Device> {
    Err(Error::DeviceNotBuilt {
        device: name.to_string(),
        feature: "cuda",
        fix: "run `cargo xtask setup-cuda`, then build with `--features cuda`",
    })
}

/// One wgpu runtime of this process: its index (`N` of `wgpu:N`), the device, the adapter in words, its pool's page
/// policy, the adapter's largest device-local Vulkan heap and that heap's budget when the runtime opened (each, or
/// why it was not read).
#[cfg(feature = "wgpu")]
pub(super) struct WgpuRuntime {
    pub(super) index: u32,
    pub(super) device: Device,
    pub(super) adapter: String,
    pub(super) pages: PagePolicy,
    pub(super) heap: std::result::Result<u64, String>,
    pub(super) budget: std::result::Result<u64, String>,
}

/// The page policy `device`'s pool was opened with, where this library opened it and the runtime lets it be
/// chosen (a wgpu device); `None` otherwise (CUDA keeps its default, which shares pages).
pub fn page_policy(device: &Device) -> Option<PagePolicy> {
    #[cfg(feature = "wgpu")]
    if let Some(runtime) = wgpu_runtime_of(device) {
        return Some(runtime.pages);
    }
    let _ = device;
    None
}

/// How many wgpu devices one process may open (`wgpu:0` to `wgpu:15`).
#[cfg(feature = "wgpu")]
pub(super) const MAX_WGPU_DEVICES: usize = 16;

/// The wgpu runtimes of this process, one per `wgpu:N`: a runtime is initialised once per process, and every later
/// open of its name shares the first answer.
#[cfg(feature = "wgpu")]
static WGPU: [std::sync::OnceLock<std::result::Result<WgpuRuntime, String>>; MAX_WGPU_DEVICES] =
    [const { std::sync::OnceLock::new() }; MAX_WGPU_DEVICES];

/// The wgpu runtimes this process opened, in the order of their names.
#[cfg(feature = "wgpu")]
pub(super) fn opened_wgpu() -> impl Iterator<Item = &'static WgpuRuntime> {
    WGPU.iter().filter_map(|runtime| runtime.get()?.as_ref().ok())
}

/// The wgpu runtime this library opened for `device`, if it did.
#[cfg(feature = "wgpu")]
pub(super) fn wgpu_runtime_of(device: &Device) -> Option<&'static WgpuRuntime> {
    opened_wgpu().find(|runtime| runtime.device == *device)
}

/// Opens (once) the runtime of `wgpu:{index}`: the default adapter for 0, else the adapter at `index` in burn's
/// list of this machine's wgpu adapters ([`wgpu_adapter_kind`]).
#[cfg(feature = "wgpu")]
pub(super) fn wgpu_runtime(index: u32, pages: PagePolicy) -> &'static std::result::Result<WgpuRuntime, String> {
    use burn::tensor::wgpu::MemoryConfiguration;
    WGPU[index as usize].get_or_init(|| {
        let memory = match pages {
            PagePolicy::Adaptive => MemoryConfiguration::default(),
            PagePolicy::Exclusive => MemoryConfiguration::ExclusivePages,
        };
        let mut options = Device::wgpu_options().memory_config(memory);
        if index > 0 {
            options = options.device_kind(wgpu_adapter_kind(index)?);
        }
        let (device, setup) = options.init_with_setup().map_err(|error| format!("{error}"))?;
        let info = setup.adapter.get_info();
        let adapter = format!(
            "{} on {:?} (driver {} {}), {pages:?} pages",
            info.name, info.backend, info.driver, info.driver_info
        );
        let (heap, budget) = match info.backend {
            burn::tensor::wgpu::wgpu::Backend::Vulkan => (vulkan_heap(&info), vulkan_budget(&info)),
            other => {
                let why = format!("the adapter runs on {other:?}, not Vulkan, whose heaps are the ones read");
                (Err(why.clone()), Err(why))
            }
        };
        record_wgpu_out_of_memory_panics();
        // A device that cannot run one small kernel is no device: probe it here, where the error is typed.
        catch_device_panic(|| {
            let x = Tensor::<1>::ones([4], &device);
            (x * 2.0).sum().try_into_data().map(|_| ()).map_err(|error| error.to_string())
        })
        .map_err(|panic| panic.to_string())??;
        Ok(WgpuRuntime { index, device, adapter, pages, heap, budget })
    })
}

/// The adapter `wgpu:{index}` names: the one at `index` in burn's list of this machine's wgpu adapters
/// (`Device::enumerate(DeviceType::Wgpu)`, each adapter once, on the graphics API the runtime settles on), as the
/// kind burn selects it by. On a machine whose default adapter is listed first, `wgpu:1` is its second adapter.
/// Why not, in words, where the list has no such entry (one adapter, as on a CPU with lavapipe) or the adapter is of
/// a kind burn cannot select.
#[cfg(feature = "wgpu")]
fn wgpu_adapter_kind(index: u32) -> std::result::Result<burn::tensor::DeviceKind, String> {
    use burn::tensor::{DeviceKind, DeviceType};
    use burn_dispatch::DispatchDevice;
    use burn_dispatch::devices::{CubeDevice, WgpuDeviceKind};
    let listed = Device::enumerate(DeviceType::Wgpu);
    let Some(device) = listed.get(index as usize) else {
        return Err(format!(
            "this machine lists {} wgpu adapter(s), so wgpu:{index} names none; wgpu:0 is the default adapter and \
             wgpu:N the N-th listed (counting from 0)",
            listed.len()
        ));
    };
    #[allow(unreachable_patterns)]
    match device.as_dispatch() {
        DispatchDevice::Cube(CubeDevice::Wgpu(wgpu)) => match &wgpu.kind {
            WgpuDeviceKind::DiscreteGpu(n) => Ok(DeviceKind::DiscreteGpu(*n)),
            WgpuDeviceKind::IntegratedGpu(n) => Ok(DeviceKind::IntegratedGpu(*n)),
            WgpuDeviceKind::VirtualGpu(n) => Ok(DeviceKind::VirtualGpu(*n)),
            WgpuDeviceKind::Cpu => Ok(DeviceKind::Cpu),
            other => Err(format!("wgpu:{index} is an adapter of kind {other:?}, which burn cannot select by kind")),
        },
        other => Err(format!("burn listed {other:?} as a wgpu device")),
    }
}

/// The largest device-local memory heap of the Vulkan physical device wgpu chose (the one with the adapter's
/// vendor and device ids, and its name where several share them), read through vulkano on an instance of its own.
/// Where the driver lists a small host-visible window ahead of the real heap, the largest is the device's memory;
/// on an integrated adapter or lavapipe it is the share of system memory the driver gives the device.
#[cfg(feature = "wgpu")]
pub(super) fn vulkan_heap(adapter: &burn::tensor::wgpu::wgpu::AdapterInfo) -> std::result::Result<u64, String> {
    use vulkano::instance::{Instance, InstanceCreateFlags, InstanceCreateInfo};
    use vulkano::memory::MemoryHeapFlags;
    let library = vulkano::VulkanLibrary::new().map_err(|error| format!("cannot load the Vulkan loader: {error}"))?;
    let instance = Instance::new(
        library,
        InstanceCreateInfo { flags: InstanceCreateFlags::ENUMERATE_PORTABILITY, ..Default::default() },
    )
    .map_err(|error| format!("cannot create a Vulkan instance to read the heaps: {error}"))?;
    let devices: Vec<_> = instance
        .enumerate_physical_devices()
        .map_err(|error| format!("cannot list the Vulkan devices: {error}"))?
        .filter(|device| {
            let properties = device.properties();
            properties.vendor_id == adapter.vendor && properties.device_id == adapter.device
        })
        .collect();
    let device = match devices.as_slice() {
        [one] => one,
        [] => {
            return Err(format!(
                "no Vulkan device has the adapter's ids ({:#x}:{:#x})",
                adapter.vendor, adapter.device
            ));
        }
        several => several.iter().find(|device| device.properties().device_name == adapter.name).ok_or_else(|| {
            format!("{} Vulkan devices share the adapter's ids and none is named {:?}", several.len(), adapter.name)
        })?,
    };
    device
        .memory_properties()
        .memory_heaps
        .iter()
        .filter(|heap| heap.flags.intersects(MemoryHeapFlags::DEVICE_LOCAL))
        .map(|heap| heap.size)
        .max()
        .filter(|&size| size > 0)
        .ok_or_else(|| format!("the Vulkan device {:?} lists no device-local heap", adapter.name))
}

/// The budget of the adapter's largest device-local Vulkan heap (`VK_EXT_memory_budget`), read from `vulkaninfo
/// --text` ([`crate::vulkaninfo`]): what a new process may allocate from the heap now, the heap less what other
/// processes hold. Read before this process allocates, it is this process's room. Why not, in words, where
/// `vulkaninfo` is missing (Debian's `vulkan-tools`), fails, does not answer within
/// [`crate::vulkaninfo::TIMEOUT`] (a hung driver: it is stopped, and the open goes on with the heap), or the driver
/// does not offer the extension (lavapipe does not).
#[cfg(feature = "wgpu")]
pub(super) fn vulkan_budget(adapter: &burn::tensor::wgpu::wgpu::AdapterInfo) -> std::result::Result<u64, String> {
    let report = crate::vulkaninfo::run("vulkaninfo".as_ref(), crate::vulkaninfo::TIMEOUT)?;
    crate::vulkaninfo::device_local_budget(&report, adapter.vendor, adapter.device, &adapter.name)
}

#[cfg(feature = "wgpu")]
pub(super) fn open_wgpu(name: &DeviceName, pages: PagePolicy) -> Result<Device> {
    let index = device_index(name);
    if index as usize >= MAX_WGPU_DEVICES {
        return Err(Error::UnknownDevice {
            kind: format!("{name} (a process opens wgpu:0 to wgpu:{}; name one of those)", MAX_WGPU_DEVICES - 1),
        });
    }
    match wgpu_runtime(index, pages) {
        Ok(runtime) => Ok(runtime.device.clone()),
        Err(message) if index > 0 => Err(Error::NoDriver {
            device: name.to_string(),
            message: message.clone(),
            fix: "name an adapter this machine has (`vulkaninfo --summary` lists them; wgpu:0 is the default), or \
                  place the component on cpu or the execution device"
                .into(),
        }),
        Err(message) => Err(Error::NoDriver {
            device: name.to_string(),
            message: message.clone(),
            fix: "install a Vulkan driver (on Debian: `apt-get install mesa-vulkan-drivers libvulkan1`, whose \
                  lavapipe runs on the CPU), check `vulkaninfo --summary` lists a device, or pick another --device"
                .into(),
        }),
    }
}

/// Waits for the queued work of every device runtime this process opened (each wgpu device it opened), so a
/// process can leave with no runtime thread still working on its behalf: call it last, after the pipeline and
/// everything holding device memory is dropped. `Ok` when nothing was opened; the runtime's error, typed, when a
/// device fails to finish.
pub fn drain_devices() -> std::result::Result<(), ComponentError> {
    #[cfg(feature = "wgpu")]
    for runtime in opened_wgpu() {
        let name = DeviceName::parse(&format!("wgpu:{}", runtime.index)).map_err(ComponentError::other)?;
        runtime.device.memory_cleanup();
        check_device(&runtime.device, &name, "drain", None)?;
    }
    Ok(())
}

/// What the device `name` is, in the runtime's words (the adapter and graphics API of `wgpu:N`, the index of a
/// CUDA device); `None` before it was opened or for the host.
pub fn describe_device(name: &DeviceName) -> Option<String> {
    match name.kind() {
        #[cfg(feature = "wgpu")]
        "wgpu" | "vulkan" => {
            opened_wgpu().find(|runtime| runtime.index == device_index(name)).map(|runtime| runtime.adapter.clone())
        }
        "cuda" => Some(format!("CUDA device {}", device_index(name))),
        _ => None,
    }
}

#[cfg(not(feature = "wgpu"))]
pub(super) fn open_wgpu(name: &DeviceName, _pages: PagePolicy) -> Result<Device> {
    Err(Error::DeviceNotBuilt {
        device: name.to_string(),
        feature: "wgpu",
        fix: "build with `--features wgpu` (pipeline-zimage) and install a Vulkan driver (on Debian: \
              `apt-get install mesa-vulkan-drivers libvulkan1`)",
    })
}
