//! A UCP context and worker with their teardown, and the few helpers both ends share.

use std::ffi::CString;
use std::ptr;

use pd_ucx_sys as sys;

use super::UcxConfig;
use crate::error::TransferError;

pub(crate) fn status_error(what: &str, status: sys::ucs_status_t) -> TransferError {
    // SAFETY: ucs_status_string returns a static string for every status value.
    let text = unsafe { std::ffi::CStr::from_ptr(sys::ucs_status_string(status)) };
    TransferError::Transport(format!("{what}: {}", text.to_string_lossy()))
}

pub(crate) fn check(what: &str, status: sys::ucs_status_t) -> Result<(), TransferError> {
    if status == sys::ucs_status_t::UCS_OK {
        Ok(())
    } else {
        Err(status_error(what, status))
    }
}

/// A UCP context with one single-threaded worker. Not `Send`: it lives and dies on the
/// thread that created it.
pub(crate) struct Worker {
    pub context: sys::ucp_context_h,
    pub worker: sys::ucp_worker_h,
}

impl Worker {
    pub fn new(config: &UcxConfig) -> Result<Self, TransferError> {
        let mut ucp_config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: plain FFI calls with valid pointers; every handle created here is released
        // on every path (config below, context and worker in Drop).
        unsafe {
            check("ucp_config_read", sys::ucp_config_read(ptr::null(), ptr::null(), &mut ucp_config))?;
            let set = |name: &str, value: &str| -> Result<(), TransferError> {
                let (n, v) = (cstring(name)?, cstring(value)?);
                check(
                    &format!("UCX setting {name}={value}"),
                    sys::ucp_config_modify(ucp_config, n.as_ptr(), v.as_ptr()),
                )
            };
            let configured = set("TLS", &config.transports).and_then(|_| set("NET_DEVICES", &config.net_devices));
            if let Err(e) = configured {
                sys::ucp_config_release(ucp_config);
                return Err(e);
            }
            let params = sys::ucp_params_t {
                field_mask: sys::UCP_PARAM_FIELD_FEATURES as u64,
                features: sys::UCP_FEATURE_AM as u64,
                ..Default::default()
            };
            let mut context: sys::ucp_context_h = ptr::null_mut();
            let status = sys::ucp_init(&params, ucp_config, &mut context);
            sys::ucp_config_release(ucp_config);
            check("ucp_init", status)?;
            let worker_params = sys::ucp_worker_params_t {
                field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
                thread_mode: sys::UCS_THREAD_MODE_SINGLE,
                ..Default::default()
            };
            let mut worker: sys::ucp_worker_h = ptr::null_mut();
            if let Err(e) = check("ucp_worker_create", sys::ucp_worker_create(context, &worker_params, &mut worker)) {
                sys::ucp_cleanup(context);
                return Err(e);
            }
            Ok(Worker { context, worker })
        }
    }

    /// Makes progress on every pending operation; true if anything happened.
    pub fn progress(&self) -> bool {
        // SAFETY: the worker is valid for self's lifetime and used from this thread only.
        unsafe { sys::ucp_worker_progress(self.worker) > 0 }
    }

    /// Installs `cb` (with `arg`) as the handler of active message `id`.
    pub fn set_am_handler(
        &self,
        id: u32,
        cb: sys::ucp_am_recv_callback_t,
        arg: *mut std::ffi::c_void,
    ) -> Result<(), TransferError> {
        let params = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
            id,
            cb,
            arg,
            ..Default::default()
        };
        // SAFETY: valid worker; `arg` outlives the worker (the caller guarantees it).
        check("ucp_worker_set_am_recv_handler", unsafe { sys::ucp_worker_set_am_recv_handler(self.worker, &params) })
    }

    /// Closes `ep` (forcefully: the peer may be gone) and waits for it.
    pub fn close_ep(&self, ep: sys::ucp_ep_h) {
        let params = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: `ep` belongs to this worker and is closed once.
        unsafe {
            let request = sys::ucp_ep_close_nbx(ep, &params);
            if sys::ucs_ptr_is_ptr(request) {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
                while sys::ucp_request_check_status(request) == sys::ucs_status_t::UCS_INPROGRESS
                    && std::time::Instant::now() < deadline
                {
                    self.progress();
                }
                sys::ucp_request_free(request);
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once, in reverse order.
        unsafe {
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.context);
        }
    }
}

pub(crate) fn cstring(s: &str) -> Result<CString, TransferError> {
    CString::new(s).map_err(|_| TransferError::Protocol(format!("`{s}` contains a NUL byte")))
}

/// A `sockaddr_storage` for `addr`, with its length.
pub(crate) fn sockaddr(addr: std::net::SocketAddr) -> (libc_sockaddr::Storage, u32) {
    libc_sockaddr::from(addr)
}

/// `SocketAddr` of a `sockaddr`.
///
/// # Safety
/// `sa` must point to a valid sockaddr_in or sockaddr_in6.
pub(crate) unsafe fn socket_addr(sa: *const sys::sockaddr_storage) -> Option<std::net::SocketAddr> {
    // SAFETY: forwarded from the caller.
    unsafe { libc_sockaddr::to(sa) }
}

/// Minimal sockaddr conversions (IPv4 and IPv6) without pulling in libc.
pub(crate) mod libc_sockaddr {
    use pd_ucx_sys as sys;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

    pub type Storage = sys::sockaddr_storage;
    const AF_INET: u16 = 2;
    const AF_INET6: u16 = 10;

    pub fn from(addr: SocketAddr) -> (Storage, u32) {
        let mut storage = Storage::default();
        let base = &mut storage as *mut Storage as *mut u8;
        // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in(6); we write
        // the fields at their Linux offsets within it.
        unsafe {
            match addr.ip() {
                IpAddr::V4(ip) => {
                    std::ptr::write_unaligned(base as *mut u16, AF_INET);
                    std::ptr::write_unaligned(base.add(2) as *mut u16, addr.port().to_be());
                    std::ptr::copy_nonoverlapping(ip.octets().as_ptr(), base.add(4), 4);
                    (storage, 16)
                }
                IpAddr::V6(ip) => {
                    std::ptr::write_unaligned(base as *mut u16, AF_INET6);
                    std::ptr::write_unaligned(base.add(2) as *mut u16, addr.port().to_be());
                    std::ptr::copy_nonoverlapping(ip.octets().as_ptr(), base.add(8), 16);
                    (storage, 28)
                }
            }
        }
    }

    /// # Safety
    /// `sa` must point to a valid sockaddr_in or sockaddr_in6.
    pub unsafe fn to(sa: *const Storage) -> Option<SocketAddr> {
        let base = sa as *const u8;
        // SAFETY: forwarded from the caller; reads at the Linux field offsets.
        unsafe {
            let family = std::ptr::read_unaligned(base as *const u16);
            let port = u16::from_be(std::ptr::read_unaligned(base.add(2) as *const u16));
            match family {
                AF_INET => {
                    let mut o = [0u8; 4];
                    std::ptr::copy_nonoverlapping(base.add(4), o.as_mut_ptr(), 4);
                    Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::from(o)), port))
                }
                AF_INET6 => {
                    let mut o = [0u8; 16];
                    std::ptr::copy_nonoverlapping(base.add(8), o.as_mut_ptr(), 16);
                    Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(o)), port))
                }
                _ => None,
            }
        }
    }
}
