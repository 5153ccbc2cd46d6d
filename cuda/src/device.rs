//! The GPU: a cudarc context and stream with event tracking off (nothing in the step is a
//! cudarc slice), device and pinned host buffers that free themselves, and the kernels of
//! `kernels/step.cu` loaded once with their function handles cached.

use std::sync::Arc;

use cudarc::driver::{
    result, sys, CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};

use crate::error::{Context, Error, Result};
use crate::plan::{GemmPlan, Occupancy};

/// The PTX that build.rs compiled (empty when it found no nvcc).
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/step.ptx"));

/// A device allocation of `bytes` bytes, freed on drop.
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    /// The device address, for kernel arguments.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from malloc_sync in this context and is freed once.
            unsafe {
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

/// Page-locked host memory of `len` values of `T`: copies from and to it can sit inside a graph.
pub struct Pinned<T: Copy> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl<T: Copy> Pinned<T> {
    /// The host address, for copies the device makes (a graph's download node).
    pub fn raw(&self) -> *mut T {
        self.ptr
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: ptr holds len initialised values (zeroed at allocation) for self's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above; &mut self makes the access unique on the host.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy> Drop for Pinned<T> {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from malloc_host and is freed once.
            unsafe {
                let _ = result::free_host(self.ptr.cast());
            }
        }
    }
}

/// Handles of every kernel in `kernels/step.cu`.
pub struct Kernels {
    pub fill_uniform_bf16: CudaFunction,
    pub fill_const_bf16: CudaFunction,
    pub embed: CudaFunction,
    pub rmsnorm: CudaFunction,
    pub skinny_gemm: CudaFunction,
    pub skinny_gemm_b4: CudaFunction,
    pub skinny_gemm_deep: CudaFunction,
    pub skinny_gemm_norm: CudaFunction,
    pub skinny_gemm_b4_norm: CudaFunction,
    pub skinny_gemm_deep_norm: CudaFunction,
    /// `[plain x2, b4 x2, plain x4, b4 x4]`, then the same with the norm folded in.
    pub skinny_gemm_split: [CudaFunction; 8],
    /// 16 columns a block: `[w16, w16d]`, then the same with the norm folded in.
    pub skinny_gemm_wide: [CudaFunction; 4],
    pub rope_kv: CudaFunction,
    pub attn_partial: CudaFunction,
    pub attn_merge: CudaFunction,
    pub attn_fused: CudaFunction,
    pub attn_fused_wide: CudaFunction,
    pub argmax_rows: CudaFunction,
}

/// One GPU with its stream and kernels.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub kernels: Kernels,
    /// Multiprocessors, and how many blocks of each projection kernel fit one.
    occupancy: Occupancy,
}

impl Gpu {
    /// Opens device `ordinal` and loads the kernels.
    ///
    /// # Errors
    /// [`Error::NoPtx`] for a build without nvcc; [`Error::Driver`] when there is no usable GPU.
    pub fn new(ordinal: usize) -> Result<Self> {
        if PTX.is_empty() {
            return Err(Error::NoPtx);
        }
        // SAFETY: only probes whether the driver library can be loaded (cudarc panics otherwise).
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::Unsupported(
                "no CUDA driver (libcuda.so) on this machine".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).ctx(|| format!("opening GPU {ordinal}"))?;
        // SAFETY: the step uses raw device pointers only; no cudarc slice needs its events.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().ctx(|| "creating a stream".into())?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(PTX))
            .ctx(|| "loading the step's PTX".into())?;
        let f = |name: &str| module.load_function(name).ctx(|| format!("kernel {name}"));
        let kernels = Kernels {
            fill_uniform_bf16: f("fill_uniform_bf16")?,
            fill_const_bf16: f("fill_const_bf16")?,
            embed: f("embed")?,
            rmsnorm: f("rmsnorm")?,
            skinny_gemm: f("skinny_gemm")?,
            skinny_gemm_b4: f("skinny_gemm_b4")?,
            skinny_gemm_deep: f("skinny_gemm_deep")?,
            skinny_gemm_norm: f("skinny_gemm_norm")?,
            skinny_gemm_b4_norm: f("skinny_gemm_b4_norm")?,
            skinny_gemm_deep_norm: f("skinny_gemm_deep_norm")?,
            skinny_gemm_split: [
                f("skinny_gemm_x2")?,
                f("skinny_gemm_b4_x2")?,
                f("skinny_gemm_x4")?,
                f("skinny_gemm_b4_x4")?,
                f("skinny_gemm_norm_x2")?,
                f("skinny_gemm_b4_norm_x2")?,
                f("skinny_gemm_norm_x4")?,
                f("skinny_gemm_b4_norm_x4")?,
            ],
            skinny_gemm_wide: [
                f("skinny_gemm_w16")?,
                f("skinny_gemm_w16d")?,
                f("skinny_gemm_w16_norm")?,
                f("skinny_gemm_w16d_norm")?,
            ],
            rope_kv: f("rope_kv")?,
            attn_partial: f("attn_partial")?,
            attn_merge: f("attn_merge")?,
            attn_fused: f("attn_fused")?,
            attn_fused_wide: f("attn_fused_wide")?,
            argmax_rows: f("argmax_rows")?,
        };
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .ctx(|| "reading the multiprocessor count".into())? as usize;
        let fit = |f: &CudaFunction| -> Result<usize> {
            let mut n = 0;
            // SAFETY: queries the occupancy of a loaded kernel at its launch size.
            unsafe {
                sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f.cu_function(), 256, 0)
                    .result()
            }
            .ctx(|| "reading kernel occupancy".into())?;
            Ok(n.max(1) as usize)
        };
        // Peak bandwidth: the memory clock (kHz; two transfers a clock) times the bus width.
        let attr = |a| {
            ctx.attribute(a)
                .ctx(|| "reading the memory clock and bus width".into())
        };
        let clock_khz = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)?;
        let bus_bits = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?;
        let occupancy = Occupancy {
            sms,
            fit: fit(&kernels.skinny_gemm)?,
            fit_b4: fit(&kernels.skinny_gemm_b4)?,
            mem_gbps: 2.0 * clock_khz as f64 * 1e3 * (bus_bits as f64 / 8.0) / 1e9,
        };
        Ok(Self {
            ctx,
            stream,
            kernels,
            occupancy,
        })
    }

    /// The projection kernel of `plan`, with the RMS norm folded in or not.
    pub fn gemm(&self, plan: GemmPlan, norm: bool) -> &CudaFunction {
        let k = &self.kernels;
        match (plan, norm) {
            (GemmPlan::Plain, false) => &k.skinny_gemm,
            (GemmPlan::B4, false) => &k.skinny_gemm_b4,
            (GemmPlan::Deep, false) => &k.skinny_gemm_deep,
            (GemmPlan::Plain, true) => &k.skinny_gemm_norm,
            (GemmPlan::B4, true) => &k.skinny_gemm_b4_norm,
            (GemmPlan::Deep, true) => &k.skinny_gemm_deep_norm,
            (GemmPlan::PlainX2, n) => &k.skinny_gemm_split[4 * usize::from(n)],
            (GemmPlan::B4X2, n) => &k.skinny_gemm_split[1 + 4 * usize::from(n)],
            (GemmPlan::PlainX4, n) => &k.skinny_gemm_split[2 + 4 * usize::from(n)],
            (GemmPlan::B4X4, n) => &k.skinny_gemm_split[3 + 4 * usize::from(n)],
            (GemmPlan::W16, n) => &k.skinny_gemm_wide[2 * usize::from(n)],
            (GemmPlan::W16D, n) => &k.skinny_gemm_wide[1 + 2 * usize::from(n)],
        }
    }

    /// Multiprocessors and the blocks of the projection kernels that fit one.
    pub fn occupancy(&self) -> Occupancy {
        self.occupancy
    }

    /// The device's name, for reports.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|e| format!("unknown ({e})"))
    }

    /// `bytes` of device memory (uninitialised).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.ctx
            .bind_to_thread()
            .ctx(|| "binding the context".into())?;
        // SAFETY: a plain allocation; callers initialise it before reading.
        let ptr = unsafe { result::malloc_sync(bytes.max(16)) }
            .ctx(|| format!("allocating {bytes} bytes on the GPU"))?;
        Ok(DeviceBuffer {
            ptr,
            bytes,
            ctx: self.ctx.clone(),
        })
    }

    /// `len` zeroed values of pinned host memory.
    pub fn pinned<T: Copy>(&self, len: usize) -> Result<Pinned<T>> {
        self.ctx
            .bind_to_thread()
            .ctx(|| "binding the context".into())?;
        let bytes = (len * std::mem::size_of::<T>()).max(16);
        // SAFETY: a plain pinned allocation, zeroed before it is viewed as T (all-zero T is
        // valid for the integer and float types used here).
        let ptr = unsafe {
            let p = result::malloc_host(bytes, 0).ctx(|| format!("pinning {bytes} bytes"))?;
            std::ptr::write_bytes(p.cast::<u8>(), 0, bytes);
            p.cast::<T>()
        };
        Ok(Pinned {
            ptr,
            len,
            ctx: self.ctx.clone(),
        })
    }

    /// Host to device copy on the stream (asynchronous for pinned `src`).
    pub fn upload<T: Copy>(
        &self,
        dst: &DeviceBuffer,
        offset_bytes: usize,
        src: &[T],
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(src);
        if offset_bytes + bytes > dst.bytes {
            return Err(Error::Invalid(format!(
                "upload of {bytes} bytes past a {}-byte buffer",
                dst.bytes
            )));
        }
        // SAFETY: the range is inside dst (checked); src outlives the copy (callers sync or use
        // pinned memory they keep).
        unsafe {
            result::memcpy_htod_async(dst.ptr + offset_bytes as u64, src, self.stream.cu_stream())
        }
        .ctx(|| "copy to the GPU".into())
    }

    /// Device to host copy on the stream.
    pub fn download<T: Copy>(
        &self,
        dst: &mut [T],
        src: &DeviceBuffer,
        offset_bytes: usize,
    ) -> Result<()> {
        let bytes = std::mem::size_of_val(dst);
        if offset_bytes + bytes > src.bytes {
            return Err(Error::Invalid(format!(
                "download of {bytes} bytes past a {}-byte buffer",
                src.bytes
            )));
        }
        // SAFETY: the range is inside src (checked); dst outlives the copy (callers sync).
        unsafe {
            result::memcpy_dtoh_async(dst, src.ptr + offset_bytes as u64, self.stream.cu_stream())
        }
        .ctx(|| "copy from the GPU".into())
    }

    /// Launches `f` on the stream. With `pdl` (programmatic dependent launch) the kernel may
    /// be scheduled while the previous one still runs: the kernels' `grid_wait()` orders their
    /// memory accesses.
    ///
    /// # Safety
    /// `args` must point at live values matching the kernel's parameters, and every pointer
    /// among them at memory the kernel may access for this grid.
    pub unsafe fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32),
        block: u32,
        pdl: bool,
        args: &mut [*mut std::ffi::c_void],
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: a zeroed attribute is valid; only the fields set below are read.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl),
        };
        // SAFETY: config and attr outlive the call; the caller vouches for args.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        }
    }

    /// Waits for everything queued on the stream.
    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .ctx(|| "synchronising the stream".into())
    }

    /// Fills `n` bf16 values at `dst` uniformly in `[-half_width, half_width]` from `seed`.
    pub fn fill_uniform(&self, dst: u64, n: usize, seed: u64, half_width: f32) -> Result<()> {
        let n = n as u64;
        let mut b = self.stream.launch_builder(&self.kernels.fill_uniform_bf16);
        b.arg(&dst).arg(&n).arg(&seed).arg(&half_width);
        // SAFETY: dst holds n bf16 values (callers size it); the argument types match the kernel.
        unsafe { b.launch(grid_stride(n)) }.ctx(|| "fill_uniform_bf16".into())?;
        Ok(())
    }

    /// Fills `n` bf16 values at `dst` with `value`.
    pub fn fill_const(&self, dst: u64, n: usize, value: f32) -> Result<()> {
        let n = n as u64;
        let mut b = self.stream.launch_builder(&self.kernels.fill_const_bf16);
        b.arg(&dst).arg(&n).arg(&value);
        // SAFETY: as fill_uniform.
        unsafe { b.launch(grid_stride(n)) }.ctx(|| "fill_const_bf16".into())?;
        Ok(())
    }
}

/// A launch for a grid-stride loop over `n` elements.
fn grid_stride(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 65_536) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Device time between two points on the stream, for benchmarks.
pub struct Timer {
    start: cudarc::driver::CudaEvent,
    stop: cudarc::driver::CudaEvent,
}

impl Timer {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        Ok(Self {
            start: gpu.ctx.new_event(flags).ctx(|| "event".into())?,
            stop: gpu.ctx.new_event(flags).ctx(|| "event".into())?,
        })
    }

    pub fn start(&self, gpu: &Gpu) -> Result<()> {
        self.start
            .record(&gpu.stream)
            .ctx(|| "recording an event".into())
    }

    /// Records the stop event, waits for it and returns the milliseconds since `start`.
    pub fn stop_ms(&self, gpu: &Gpu) -> Result<f32> {
        self.stop
            .record(&gpu.stream)
            .ctx(|| "recording an event".into())?;
        self.stop
            .synchronize()
            .ctx(|| "waiting for an event".into())?;
        self.start
            .elapsed_ms(&self.stop)
            .ctx(|| "reading an event".into())
    }
}
