/* XDP aggregation of LAN workers' fixed-point gradients at the DC gateway, and at a LAN aggregator worker.
 *
 * A DATA packet for (iteration, tensor, chunk) is added into its slot under the slot's bpf_spin_lock, so
 * packets of one slot arriving on several receive queues (CPUs) at once serialise per slot while other
 * slots proceed in parallel. Duplicates (bit already in the bitmap) are dropped. The packet that completes
 * the expected contributor mask is rewritten into the aggregate (kind AGG) and passed up to the agent's
 * UDP socket; every other DATA packet is consumed here. The first packet of a key arms the slot's
 * bpf_timer; on expiry the callback reports the slot and its bitmap through the ring buffer (it cannot
 * send packets) and re-arms itself up to max_nacks times, so the agent NACKs the missing workers.
 *
 * The datagram header (struct ns_hdr) and the NS_MAGIC, NS_VERSION, NS_KIND_*, NS_FLAG_* and NS_MAX_WORKERS
 * constants are not written here: the loader puts the text netstorm/lan/header.py generates from its
 * field table and the kinds' registry (netstorm/lan/kinds.py) in front of this file (c_definitions), so
 * Python and C share one definition of the layout and of every kind number, the loader's own TIMER_INIT too.
 *
 * Authentication (cfg.auth, when the job has a secret): a DATA packet must carry the token the agent
 * installed for its (worker, iteration) in ns_tokens (NS_TOKEN_WINDOW iterations per worker, indexed by
 * iteration modulo the window); anything else is dropped before it touches a slot and counted as
 * ST_BAD_TOKEN. No cryptography runs here: the agent derives the tokens. AGG is made only by this program,
 * so an AGG arriving from the wire is dropped the same way, and the aggregate this program passes up
 * carries cfg.agg_token, a value only the agent knows, in place of the completing worker's token.
 *
 * Slots are a pool (netstorm/lan/layout.py): chunk seq uses slot seq % pool, and a slot is taken over only by
 * a newer key (a later iteration, or a later chunk of the same iteration); an older key's packet is a
 * straggler and is dropped (its worker learns from an ACK, or by asking, that the chunk completed).
 *
 * Precision (PAHInA): DATA lanes are int32 fixed point at the header's scale, or fp16, bf16 or int8 at the
 * sender's wscale; each lane is converted exactly (integer shifts, rounding half to even) to int32 fixed
 * point at the header's scale, the slot's common scale, before it is added. A narrow packet is grown at its
 * tail (bpf_xdp_adjust_tail) before anything else, so whichever packet completes the slot has room for the
 * int32 aggregate; a frame without that much tailroom is passed up, and the agent widens it in userspace and
 * runs it through this program (BPF_PROG_TEST_RUN), so the slot logic stays here.
 *
 * Forwarding (cfg.forward, a cluster's aggregator, two-level LAN): the packet that completes a slot is
 * rewritten into this aggregator's own DATA for the gateway (worker cfg.up_worker, the token the agent
 * installed for it, addresses of cfg) and sent out of cfg.up_ifindex: XDP_TX when it came in there, else
 * bpf_redirect (the aggregator's own packets, which reach the program on the loopback device).
 *
 * Results from the kernel (cfg.results, a gateway whose LAN sum is the result: a job of one DC): the packet that
 * completes a slot without overflow is rewritten into the RESULT of its chunk (precision SCALED32: the int32 sum
 * at the slot's scale, which each worker converts as the agent would) for the workers' multicast group, with the
 * group's token for the iteration, and sent back out (XDP_TX); the bridge or switch copies it to every member. A
 * retransmission for a completed slot sends it again (its worker lost it). The slots are shadow slots (the
 * workers number chunks across iterations and keep half the pool in flight, netstorm/lan/layout.py), so a slot
 * is taken over only after every worker had its result. ns_done counts each iteration's completed chunks; the
 * last one is reported through the ring buffer (slot NS_ITERATION_DONE). An overflowed slot still goes up to
 * the agent as AGG, which has the workers re-quantise.
 *
 * Horizon (cfg.bounded): DATA of an iteration newer than cfg.horizon is dropped and counted (ST_FUTURE) before it
 * touches a slot. The agent raises the horizon as iterations complete or fail; in results mode the packet that
 * completes an iteration raises it here, since its workers may send the next one at once.
 *
 * Uplink meter (netstorm/lan/uplinks.py): every DATA packet of an expected worker that passed the token check counts
 * towards NS_METER_MAP's entry for its worker and iteration (one per worker and iteration of a window, indexed
 * by iteration modulo NS_TOKEN_WINDOW, then worker, so an iteration's entries are consecutive): its UDP payload
 * bytes as sent and its arrival time, for the first cfg.meter_packets datagrams (the worker's first window,
 * sent back to back before any ACK wait). The agent reads an iteration's entries with one batched lookup. A
 * frame the agent runs through this program itself (a narrow datagram widened in userspace) carries a struct
 * ns_arrival as XDP metadata: the datagram's arrival time and size on the wire, counted in place of the run's.
 *
 * Defined by the loader: NS_LANES, NS_SLOTS, NS_RING_PAGES (room for a report from every slot), NS_SLOT_MAP
 * (replaced by the shared table's name), NS_METER_MAP and NS_METER_ENTRIES (the meter's table and its
 * NS_MAX_WORKERS * NS_TOKEN_WINDOW entries), NS_TOKEN_WINDOW (a power of two), TIMER_MAP_FD, TIMER_CB_MARK (64-bit constant the loader turns into a
 * BPF_PSEUDO_FUNC reference to ns_timer_cb). */
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include "slot.h"

#define NS_CLOCK_MONOTONIC 1

enum ns_stat {
    ST_RX, ST_DUP, ST_COMPLETE, ST_STALE, ST_COLLISION, ST_BAD, ST_UNEXPECTED, ST_OVERFLOW, ST_REEMIT,
    ST_TIMER_EVENTS, ST_BUSY_EVICTED, ST_TIMER_FAIL, ST_REPORT_LOST, ST_BAD_TOKEN, ST_FORWARDED, ST_WIDEN_UP,
    ST_OLD_EPOCH, ST_RESULT, ST_ITERATION_DONE, ST_GAP_REPORTS, ST_FUTURE, NS_NSTATS
};

struct ns_cfg {
    u64 expected;               /* contributor mask installed by the agent */
    u64 timeout_ns;             /* slot timer period */
    u16 job;
    u16 port;                   /* this program's UDP port, host order */
    u8 max_nacks;               /* timer expiries reported per key before the slot gives up */
    u8 auth;                    /* 1: DATA must carry the token installed for its worker and iteration */
    u8 forward;                 /* 1: completed slots go to the gateway as DATA (a cluster aggregator) */
    u8 up_worker;               /* forwarding: this aggregator's worker id at the gateway */
    u64 agg_token;              /* written into every aggregate passed up (the agent checks it) */
    u32 up_ifindex;             /* forwarding: the interface towards the gateway */
    u32 up_ip;                  /* forwarding: gateway IPv4, network order */
    u32 own_ip;                 /* forwarding: this host's IPv4 on up_ifindex, network order */
    u16 up_port;                /* forwarding: gateway UDP port, network order */
    u16 own_port;               /* forwarding: source UDP port, network order */
    u8 up_mac[6];
    u8 own_mac[6];
    u32 meter_packets;          /* datagrams per worker and iteration the uplink meter counts (the pool) */
    u32 epoch;                  /* the LAN deployment epoch DATA must carry (netstorm/lan/redeploy.py) */
    u32 results;                /* 1: a completed slot goes back to the workers from here as RESULT */
    u32 result_total;           /* results: the workers a result sums (its header's total) */
    u32 chunks;                 /* results: chunks per iteration (an iteration completes with its last) */
    u32 group_ip;               /* results: the workers' multicast group, network order */
    u16 group_port;             /* results: the group's UDP port, network order */
    u8 group_mac[6];            /* results: the group's Ethernet address */
    u32 horizon;                /* bounded: the newest iteration whose DATA is summed */
    u32 bounded;                /* 1: DATA of an iteration past horizon is refused (ST_FUTURE) */
};

/* How many of an iteration's chunks this program returned results for (results mode): one entry per iteration
 * of the token window; the one that completes the iteration reports it through the ring buffer. */
struct ns_done {
    struct bpf_spin_lock lock;
    u32 iteration;
    u32 count;
};
#define NS_ITERATION_DONE 0xffffffffu   /* ns_event.slot of an iteration-complete report */

struct ns_token {
    u32 iteration;
    u32 pad;
    u64 token;                  /* never 0 when installed: an empty entry matches nothing */
};

/* XDP metadata of a frame the agent runs through the program (BPF_PROG_TEST_RUN): when and how large the
 * datagram it came from arrived, for the uplink meter. */
struct ns_arrival {
    u64 ns;
    u32 bytes;
    u32 magic;                  /* NS_ARRIVAL_MAGIC */
};
#define NS_ARRIVAL_MAGIC 0x4e534152

struct ns_event {
    u32 iteration;
    u32 tensor;
    u32 chunk;
    u32 slot;
    u64 bitmap;
    u64 expected;
    u16 job;
    u8 scale;                   /* the slot's s8 scale, as a byte */
    u8 nacks;
    u32 pad;
};

BPF_TABLE("extern", u32, struct ns_slot, NS_SLOT_MAP, NS_SLOTS);
BPF_TABLE("extern", u32, struct ns_meter, NS_METER_MAP, NS_METER_ENTRIES);
BPF_ARRAY(ns_cfg, struct ns_cfg, 1);
/* one window per worker, then one for the group: the token a RESULT this program sends carries */
BPF_ARRAY(ns_tokens, struct ns_token, (NS_MAX_WORKERS + 1) * NS_TOKEN_WINDOW);
BPF_ARRAY(ns_done, struct ns_done, NS_TOKEN_WINDOW);
BPF_PERCPU_ARRAY(ns_stats, u64, NS_NSTATS);
BPF_RINGBUF_OUTPUT(ns_events, NS_RING_PAGES);

static __always_inline void bump(u32 index)
{
    u64 *value = ns_stats.lookup(&index);
    if (value)
        *value += 1;
}

/* Copy NS_LANES int32 lanes eight bytes at a time (half the loads and stores of a lane-wise copy): a slot's
 * lanes start 8-byte aligned; a packet's may not, which BPF allows where the architecture does (x86-64). */
_Static_assert(__builtin_offsetof(struct ns_slot, lanes) % 8 == 0, "ns_slot.lanes 8-byte aligned");
static __always_inline void ns_copy_lanes(s32 *to, s32 *from)
{
    u64 *to2 = (u64 *)to, *from2 = (u64 *)from;
    for (u32 i = 0; i < NS_LANES / 2; i++)
        to2[i] = from2[i];
    if (NS_LANES & 1)
        to[NS_LANES - 1] = from[NS_LANES - 1];
}

/* Hide a value from the optimiser, so mask arithmetic stays arithmetic instead of becoming a branch (BPF has
 * no conditional move; per-lane branches would multiply the verifier's states). */
#define NS_OPAQUE(x) asm volatile("" : "+r"(x))

/* m * 2**k rounded half to even, branch-free (m < 2**24, |k| < 2**16); *ovf gets 1 when it leaves int32. */
static __always_inline s64 ns_shift(u64 m, s64 k, u64 *ovf)
{
    u64 neg = (u64)k >> 63;             /* 1: shift right */
    NS_OPAQUE(neg);
    u64 mask = -neg;
    u64 left = (u64)k & ~mask;
    u64 right = (u64)(-k) & mask;
    u64 big = (u64)(40 - (s64)left) >> 63;     /* left > 40: saturate (m != 0 overflows anyway) */
    NS_OPAQUE(big);
    left = (left & ~(-big)) | (40 & -big);
    big = (u64)(40 - (s64)right) >> 63;        /* right > 40: the result is 0 */
    NS_OPAQUE(big);
    right = (right & ~(-big)) | (40 & -big);
    u64 up = m << (left & 63);
    u64 q = m >> (right & 63);
    u64 unit = 1ULL << (right & 63);
    u64 rem = m & (unit - 1);
    u64 half = unit >> 1;
    u64 above = (half - rem) >> 63;                    /* rem > half */
    u64 tie = (((rem ^ half) - 1) >> 63) & ((0 - right) >> 63); /* rem == half, right > 0 */
    q += above | (tie & q & 1);
    u64 v = (q & mask) | (up & ~mask);
    *ovf |= v >> 31;
    return (s64)v;
}

/* One int8 lane (value q * 2**-wscale) as int32 fixed point at scale s. */
static __always_inline s64 ns_int8(u32 raw, s64 s, s64 wscale, u64 *ovf)
{
    s64 q = (s8)raw;
    u64 sign = (u64)q >> 63;
    u64 m = (u64)((q ^ -(s64)sign) + (s64)sign);
    s64 v = ns_shift(m, s - wscale, ovf);
    return (v ^ -(s64)sign) + (s64)sign;
}

/* One 16-bit float lane (fp16: 5 exponent and 10 mantissa bits, bias 15; bf16: 8 and 7, bias 127) as int32
 * fixed point at scale s: the value is m * 2**(e - bias - mbits), or f * 2**(1 - bias - mbits) when e = 0.
 * The format arrives as numbers (ebits, mbits, bias), so one loop serves both. */
static __always_inline s64 ns_float16(u32 raw, u64 ebits, u64 mbits, s64 bias, s64 s, u64 *ovf)
{
    u64 emask = (1ULL << (ebits & 15)) - 1;
    u64 e = (raw >> (mbits & 15)) & emask;
    u64 nz = (e + emask) >> (ebits & 15);          /* e != 0 */
    *ovf |= (e + 1) >> (ebits & 15);               /* e all ones: inf or nan */
    u64 sign = (raw >> 15) & 1;
    u64 m = (raw & ((1ULL << (mbits & 15)) - 1)) | (nz << (mbits & 15));
    s64 v = ns_shift(m, (s64)e - bias - (s64)mbits + (s64)(1 - nz) + s, ovf);
    return (v ^ -(s64)sign) + (s64)sign;
}

/* Timer callback: the kernel calls it with (map, key, value); bcc would rewrite a three-parameter
 * function as a kprobe, so it takes one parameter and reads the value pointer from r3. */
/* A report of ``slot`` (called under its lock): its key, contributors, scale and reports so far. */
static __always_inline void ns_slot_event(struct ns_event *ev, struct ns_slot *slot)
{
    ev->iteration = slot->iteration;
    ev->tensor = slot->tensor;
    ev->chunk = slot->chunk;
    ev->slot = slot->index;
    ev->bitmap = slot->bitmap;
    ev->scale = slot->scale;
    ev->nacks = slot->nacks;
}

/* The token installed for ``owner``'s window entry (a worker's id, or NS_MAX_WORKERS: the group) of
 * ``iteration``, or NULL when that entry holds another iteration or nothing. */
static __always_inline struct ns_token *ns_token_of(u32 owner, u32 iteration)
{
    u32 at = owner * NS_TOKEN_WINDOW + (iteration & (NS_TOKEN_WINDOW - 1));
    struct ns_token *tok = ns_tokens.lookup(&at);
    if (!tok || tok->iteration != iteration || !tok->token)
        return NULL;
    return tok;
}

int ns_timer_cb(void *map)
{
    struct ns_slot *slot;
    asm volatile("%0 = r3" : "=r"(slot));
    u32 zero = 0;
    struct ns_cfg *cfg = ns_cfg.lookup(&zero);
    if (!cfg)
        return 0;
    u64 expected = cfg->expected;
    struct ns_event ev = {};
    int report = 0, rearm = 0;
    bpf_spin_lock(&slot->lock);
    if (slot->busy && slot->bitmap != expected && slot->nacks < cfg->max_nacks) {
        slot->nacks += 1;
        report = 1;
        rearm = slot->nacks < cfg->max_nacks;
        ns_slot_event(&ev, slot);
    }
    bpf_spin_unlock(&slot->lock);
    if (report) {
        ev.expected = expected;
        ev.job = cfg->job;
        if (ns_events.ringbuf_output(&ev, sizeof(ev), 0)) {
            /* ring full (the agent is behind): the report is lost, so it must not use up one of the slot's
             * max_nacks reports; the timer tries again next period */
            bump(ST_REPORT_LOST);
            bpf_spin_lock(&slot->lock);
            if (slot->busy && slot->iteration == ev.iteration && slot->nacks == ev.nacks)
                slot->nacks -= 1;
            bpf_spin_unlock(&slot->lock);
            rearm = 1;
        } else {
            bump(ST_TIMER_EVENTS);
        }
        if (rearm)
            bpf_timer_start(&slot->timer, cfg->timeout_ns, 0);
    }
    return 0;
}

/* Count one DATA datagram of ``bytes`` arriving at ``now`` towards its worker's entry for the iteration: a
 * newer iteration takes the entry over, an older one is ignored, and only the first cfg->meter_packets count. */
static __always_inline void ns_measure(struct ns_cfg *cfg, u32 worker, u32 iteration, u64 bytes, u64 now)
{
    u32 at = (iteration & (NS_TOKEN_WINDOW - 1)) * NS_MAX_WORKERS + (worker & (NS_MAX_WORKERS - 1));
    struct ns_meter *m = NS_METER_MAP.lookup(&at);
    if (!m)
        return;
    u32 cap = cfg->meter_packets;
    /* past its first window a worker's datagrams no longer count: seen without the lock (a stale read can only
     * be of this iteration's full entry, or an older one, which the locked path below also takes over) */
    if (*(volatile u32 *)&m->iteration == iteration && *(volatile u32 *)&m->packets >= cap)
        return;
    bpf_spin_lock(&m->lock);
    s32 age = (s32)(iteration - m->iteration);
    if (age > 0 || !m->packets) {
        m->iteration = iteration;
        m->packets = 0;
        m->bytes = 0;
        m->first_ns = now;
        m->last_ns = now;
    }
    if (m->iteration == iteration && m->packets < cap) {
        m->packets += 1;
        m->bytes += bytes;
        if (now < m->first_ns)
            m->first_ns = now;
        if (now > m->last_ns)
            m->last_ns = now;
    }
    bpf_spin_unlock(&m->lock);
}

static __always_inline u16 ns_csum_fold(u32 sum)
{
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    return ~sum;
}

/* The IPv4 header's checksum, after its fields changed. */
static __always_inline void ns_ip_checksum(struct iphdr *ip)
{
    ip->check = 0;
    u32 sum = 0;
    u16 *words = (u16 *)ip;
    for (int i = 0; i < 10; i++)
        sum += words[i];
    ip->check = ns_csum_fold(sum);
}

/* Address a datagram this program sends itself: Ethernet, IPv4 and UDP source and destination (addresses and
 * ports in network order), the TTL, a fresh IP checksum and no UDP checksum (zero over IPv4: none). */
static __always_inline void ns_readdress(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp, u8 *dst_mac,
                                         u8 *src_mac, u32 saddr, u32 daddr, u16 sport, u16 dport, u8 ttl)
{
    __builtin_memcpy(eth->h_dest, dst_mac, 6);
    __builtin_memcpy(eth->h_source, src_mac, 6);
    ip->saddr = saddr;
    ip->daddr = daddr;
    ip->ttl = ttl;
    ns_ip_checksum(ip);
    udp->source = sport;
    udp->dest = dport;
    udp->check = 0;
}

/* Rewrite a completed aggregate (already in the packet, kind set by the caller) into this aggregator's DATA
 * for the gateway and send it; returns the XDP verdict. */
static __always_inline int ns_forward(struct xdp_md *ctx, struct ns_cfg *cfg, u32 iteration)
{
    void *data = (void *)(long)ctx->data;
    void *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = (void *)(eth + 1);
    struct udphdr *udp = (void *)(ip + 1);
    struct ns_hdr *h = (void *)(udp + 1);
    if ((void *)(h + 1) > end)
        return XDP_DROP;
    u32 up = cfg->up_worker;
    u64 token = 0;
    if (cfg->auth) {
        struct ns_token *tok = ns_token_of(up, iteration);
        if (!tok)
            return XDP_DROP;
        token = tok->token;
    }
    h->kind = NS_KIND_DATA;
    h->worker = up;
    h->token = token;
    h->precision = NS_PREC_FIXED32;
    h->wscale = 0;
    ns_readdress(eth, ip, udp, cfg->up_mac, cfg->own_mac, cfg->own_ip, cfg->up_ip, cfg->own_port, cfg->up_port, 64);
    bump(ST_FORWARDED);
    if (ctx->ingress_ifindex == cfg->up_ifindex)
        return XDP_TX;
    return bpf_redirect(cfg->up_ifindex, 0);
}

/* Count a chunk of ``iteration`` that completed here (results mode); the one that completes the iteration is
 * reported through the ring buffer (the agent then expects the next iteration). A result that could not leave
 * (no group token yet) still counts: its workers send their DATA again, and the slot sends it again. */
static __always_inline void ns_count_done(struct ns_cfg *cfg, u32 iteration)
{
    u32 at = iteration & (NS_TOKEN_WINDOW - 1);
    struct ns_done *d = ns_done.lookup(&at);
    if (!d)
        return;
    int complete = 0;
    bpf_spin_lock(&d->lock);
    if (d->iteration != iteration) {
        d->iteration = iteration;
        d->count = 0;
    }
    d->count += 1;
    complete = d->count == cfg->chunks;
    bpf_spin_unlock(&d->lock);
    if (complete && cfg->bounded && (s32)(iteration + 1 - cfg->horizon) > 0)
        cfg->horizon = iteration + 1;   /* its workers have every result: the next one's DATA may come now */
    if (complete) {
        struct ns_event ev = {};
        ev.iteration = iteration;
        ev.slot = NS_ITERATION_DONE;
        ev.job = cfg->job;
        /* a lost report (the ring full) costs the agent a read of this count instead */
        if (ns_events.ringbuf_output(&ev, sizeof(ev), 0))
            bump(ST_REPORT_LOST);
        else
            bump(ST_ITERATION_DONE);
    }
}

/* The gap rule, in the program (results mode, where no aggregate reaches the agent to apply it there): chunk
 * ``index``'s key just completed, and each worker sends its chunks in order on one flow, which one receive
 * queue takes in order; so the slot before it, if it still holds an older key that is open, lost a datagram.
 * It is reported once, as a slot timer would report it, so the agent NACKs its missing workers now instead
 * of after their QUERY or the timer's period. */
static __always_inline void ns_report_gap(struct ns_cfg *cfg, u32 index, u32 iteration, u32 tensor, u32 chunk)
{
    u32 prev = index ? index - 1 : NS_SLOTS - 1;
    struct ns_slot *p = NS_SLOT_MAP.lookup(&prev);
    if (!p)
        return;
    u64 expected = cfg->expected;
    struct ns_event ev = {};
    int report = 0;
    bpf_spin_lock(&p->lock);
    s32 age = (s32)(iteration - p->iteration);
    int older = age > 0 || (age == 0 && (p->tensor < tensor || (p->tensor == tensor && p->chunk < chunk)));
    if (p->busy && !p->gap && older && p->bitmap != expected) {
        p->gap = 1;
        report = 1;
        ns_slot_event(&ev, p);
    }
    bpf_spin_unlock(&p->lock);
    if (report) {
        ev.expected = expected;
        ev.job = cfg->job;
        if (ns_events.ringbuf_output(&ev, sizeof(ev), 0))
            bump(ST_REPORT_LOST);
        else
            bump(ST_GAP_REPORTS);
    }
}

/* Rewrite a completed aggregate (already in the packet, at full length) into the RESULT of its chunk for the
 * workers' multicast group and send it back out where it came in; the bridge replicates it to every member.
 * The lanes stay the slot's int32 fixed-point sum (precision SCALED32 at the slot's scale): each worker turns
 * them into float32 exactly as the agent would. The same rewrite re-emits the result of a completed slot for a
 * worker that lost it and sent its DATA again. */
static __always_inline int ns_result(struct xdp_md *ctx, struct ns_cfg *cfg, u32 iteration)
{
    void *data = (void *)(long)ctx->data;
    void *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = (void *)(eth + 1);
    struct udphdr *udp = (void *)(ip + 1);
    struct ns_hdr *h = (void *)(udp + 1);
    if ((void *)(h + 1) > end)
        return XDP_DROP;
    u64 token = 0;
    if (cfg->auth) {
        struct ns_token *tok = ns_token_of(NS_MAX_WORKERS, iteration);
        if (!tok) {
            bump(ST_BAD_TOKEN);     /* no group token installed: the workers' resends ask again */
            return XDP_DROP;
        }
        token = tok->token;
    }
    h->kind = NS_KIND_RESULT;
    h->worker = 0;
    h->token = token;
    h->precision = NS_PREC_SCALED32;
    h->wscale = 0;
    h->flags = 0;
    h->need = NS_NEED_NONE;
    h->total = cfg->result_total;
    /* TTL 1: the group is the LAN's own */
    ns_readdress(eth, ip, udp, cfg->group_mac, cfg->own_mac, cfg->own_ip, cfg->group_ip, cfg->own_port,
                 cfg->group_port, 1);
    bump(ST_RESULT);
    return XDP_TX;
}

int ns_aggregate(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data;
    void *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > end || eth->h_proto != htons(ETH_P_IP))
        return XDP_PASS;
    struct iphdr *ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_UDP || ip->ihl != 5 || (ip->frag_off & htons(0x3fff)))
        return XDP_PASS;
    struct udphdr *udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > end)
        return XDP_PASS;
    u32 zero = 0;
    struct ns_cfg *cfg = ns_cfg.lookup(&zero);
    if (!cfg || udp->dest != htons(cfg->port))
        return XDP_PASS;
    struct ns_hdr *h = (void *)(udp + 1);
    if ((void *)(h + 1) > end)
        return XDP_PASS;
    if (h->magic == NS_MAGIC && h->version == NS_VERSION && h->kind == NS_KIND_TIMER_INIT) {
        /* bpf_timer_init allocates; in NAPI context that can fail under load, so the loader initialises
         * every slot's timer up front through BPF_PROG_TEST_RUN and the data path only (re)starts it. */
        u32 index = h->slot;
        struct ns_slot *slot = NS_SLOT_MAP.lookup(&index);
        if (!slot)
            return XDP_ABORTED;
        long err = bpf_timer_init(&slot->timer, (void *)bpf_pseudo_fd(1, TIMER_MAP_FD), NS_CLOCK_MONOTONIC);
        if (!err || err == -16)
            err = bpf_timer_set_callback(&slot->timer, (void *)TIMER_CB_MARK);
        h->total = (u32)-err;       /* the loader reads the errno back from the frame's total */
        return err ? XDP_ABORTED : XDP_DROP;
    }
    if (cfg->auth && h->magic == NS_MAGIC && h->kind == NS_KIND_AGG) {
        bump(ST_BAD_TOKEN);         /* only this program makes aggregates: one from the wire is forged */
        return XDP_DROP;
    }
    /* Anything but our job's DATA goes to the agent, which answers malformed input with a clear error. */
    if (h->magic != NS_MAGIC || h->version != NS_VERSION || h->kind != NS_KIND_DATA || h->job != cfg->job)
        return XDP_PASS;
    bump(ST_RX);
    /* the uplink meter's view of this datagram: its size as sent and when it arrived (the agent's metadata
     * when the agent runs it through here itself) */
    u64 wire = (u64)((long)end - (long)h);
    u64 arrived = bpf_ktime_get_ns();
    {
        struct ns_arrival *meta = (void *)(long)ctx->data_meta;
        if ((void *)(meta + 1) <= data && meta->magic == NS_ARRIVAL_MAGIC) {
            wire = meta->bytes;
            arrived = meta->ns;
        }
    }
    u32 prec = h->precision;
    if (prec > NS_PREC_INT8) {
        bump(ST_BAD);
        return XDP_PASS;
    }
    if (prec != NS_PREC_FIXED32) {
        /* narrow lanes: grow the packet at its tail to int32 lanes and convert in place, last lane first (lane
         * i's int32 bytes only cover narrow lanes >= i, already converted), before any slot is touched */
        u32 width = prec == NS_PREC_INT8 ? 1 : 2;
        u64 have = (u64)((long)end - (long)(h + 1));
        if (have != NS_LANES * width) {
            bump(ST_BAD);
            return XDP_PASS;
        }
        if (bpf_xdp_adjust_tail(ctx, (int)(NS_LANES * (4 - width)))) {
            /* no tailroom in this frame (generic mode, or a driver's small buffers): the agent widens it at
             * ingress and runs it through this program from process context */
            bump(ST_WIDEN_UP);
            return XDP_PASS;
        }
        data = (void *)(long)ctx->data;
        end = (void *)(long)ctx->data_end;
        eth = data;
        ip = (void *)(eth + 1);
        udp = (void *)(ip + 1);
        h = (void *)(udp + 1);
        s32 *wide = (s32 *)(h + 1);
        if ((void *)(wide + NS_LANES) > end)
            return XDP_DROP;
        s64 s = h->scale, wscale = h->wscale;
        u64 bad = 0;
        if (prec == NS_PREC_INT8) {
            u8 *narrow = (u8 *)wide;
            for (s32 i = NS_LANES - 1; i >= 0; i--)
                wide[i] = (s32)ns_int8(narrow[i], s, wscale, &bad);
        } else {
            u16 *narrow = (u16 *)wide;
            u64 ebits = prec == NS_PREC_FP16 ? 5 : 8, mbits = prec == NS_PREC_FP16 ? 10 : 7;
            s64 bias = prec == NS_PREC_FP16 ? 15 : 127;
            NS_OPAQUE(ebits);       /* one verifier path for both formats */
            NS_OPAQUE(mbits);
            NS_OPAQUE(bias);
            for (s32 i = NS_LANES - 1; i >= 0; i--)
                wide[i] = (s32)ns_float16(narrow[i], ebits, mbits, bias, s, &bad);
        }
        if (bad)
            h->flags |= NS_FLAG_OVERFLOW;   /* a lane left int32 at this scale: the slot will ask to rescale */
        h->precision = NS_PREC_FIXED32;
        h->wscale = 0;
    }
    u32 count = h->count;
    u32 worker = h->worker;
    /* DATA always carries NS_LANES lanes (zero beyond count): fixed-trip loops keep the verifier linear. */
    s32 *in = (s32 *)(h + 1);
    if (count == 0 || count > NS_LANES || worker >= NS_MAX_WORKERS || (h->flags & ~NS_FLAG_OVERFLOW) ||
        (void *)(in + NS_LANES) > end) {
        bump(ST_BAD);
        return XDP_PASS;
    }
    if (cfg->auth) {
        struct ns_token *want = ns_token_of(worker, h->iteration);
        if (!want || want->token != h->token) {
            bump(ST_BAD_TOKEN);
            return XDP_DROP;
        }
    }
    if (cfg->bounded && (s32)(h->iteration - cfg->horizon) > 0) {
        /* an iteration beyond the window: no worker can have it yet (each needs every result of the one
         * before), and taking a slot for it would evict a chunk still being summed */
        bump(ST_FUTURE);
        return XDP_DROP;
    }
    if (h->epoch != cfg->epoch) {
        /* DATA of another deployment: never summed here; passed to this port's socket, whose service tells
         * its sender to say HELLO again (MOVED) */
        bump(ST_OLD_EPOCH);
        return XDP_PASS;
    }
    u64 bit = 1ULL << worker;
    u64 expected = cfg->expected;
    if (!(expected & bit)) {
        bump(ST_UNEXPECTED);
        return XDP_DROP;
    }
    ns_measure(cfg, worker, h->iteration, wire, arrived);
    u32 index = h->slot;
    struct ns_slot *slot = NS_SLOT_MAP.lookup(&index);
    if (!slot) {
        bump(ST_BAD);
        return XDP_PASS;
    }
    u32 iteration = h->iteration, tensor = h->tensor, chunk = h->chunk;
    s8 scale = h->scale;
    int first = 0, last = 0, stat = -1, add = 0;
    u64 ovf = 0;

    bpf_spin_lock(&slot->lock);
    int same = slot->iteration == iteration && slot->tensor == tensor && slot->chunk == chunk;
    s32 age = (s32)(iteration - slot->iteration);
    int newer = age > 0 || (age == 0 && (tensor > slot->tensor || (tensor == slot->tensor && chunk > slot->chunk)));
    /* contributors the current deployment does not expect here: the slot filled before a change of the
     * expected mask (netstorm/lan/redeploy.py), so it starts over rather than hand on a sum of another cluster */
    u64 foreign = slot->bitmap & ~expected;
    if (same && scale == slot->scale && slot->bitmap && !foreign) {
        if (count != slot->count) {
            stat = ST_BAD;
        } else if (slot->bitmap & bit) {
            if (slot->bitmap != expected) {
                stat = ST_DUP;
                slot->busy = 1;     /* a slot completed under another mask waits for the rest of this one */
            } else if (slot->busy) {
                slot->busy = 0;     /* complete under a mask that shrank since its contributors came */
                last = 1;
                stat = ST_COMPLETE;
            } else {
                last = 1;           /* a retransmission after completion: hand the aggregate on again */
                stat = ST_REEMIT;
            }
        } else {
            add = 1;
        }
    } else if ((same && (scale < slot->scale || foreign)) || newer || !slot->bitmap) {
        if (slot->busy && !same)
            stat = ST_BUSY_EVICTED;     /* a newer key took over a slot that never completed */
        slot->iteration = iteration;
        slot->tensor = tensor;
        slot->chunk = chunk;
        slot->index = index;
        slot->scale = scale;
        slot->count = count;
        slot->need = NS_NEED_NONE;
        slot->flags = 0;
        slot->nacks = 0;
        slot->gap = 0;
        slot->bitmap = 0;
        slot->busy = 1;
        first = 1;                  /* the first contribution is copied in, not added to zeroed lanes */
        add = 1;
    } else {
        stat = same ? ST_STALE : (age == 0 ? ST_COLLISION : ST_STALE);
    }
    if (add && first) {
        ns_copy_lanes(slot->lanes, in);     /* one int32 cannot leave int32 */
    } else if (add) {
        for (u32 i = 0; i < NS_LANES; i++) {
            s64 sum = (s64)slot->lanes[i] + (s64)in[i];
            ovf |= (u64)(sum + 0x80000000LL) >> 32;
            slot->lanes[i] = (s32)sum;
        }
    }
    if (add) {
        slot->bitmap |= bit;
        slot->flags |= (h->flags & NS_FLAG_OVERFLOW) | (ovf ? NS_FLAG_OVERFLOW : 0);
        if (h->need < slot->need)
            slot->need = h->need;
        if (slot->bitmap == expected) {
            slot->busy = 0;
            last = 1;
            stat = ST_COMPLETE;
        }
    }
    if (last) {
        ns_copy_lanes(in, slot->lanes);
        h->kind = NS_KIND_AGG;
        h->flags = slot->flags;
        h->need = slot->need;
    }
    bpf_spin_unlock(&slot->lock);

    if (stat >= 0)
        bump(stat);
    if (ovf)
        bump(ST_OVERFLOW);
    if (first && !last) {
        /* -EBUSY once the slot's timer is initialised: harmless, the callback stays the same. */
        long err = bpf_timer_init(&slot->timer, (void *)bpf_pseudo_fd(1, TIMER_MAP_FD), NS_CLOCK_MONOTONIC);
        if (err && err != -16 /* EBUSY: initialised before */)
            bump(ST_TIMER_FAIL);
        if (bpf_timer_set_callback(&slot->timer, (void *)TIMER_CB_MARK))
            bump(ST_TIMER_FAIL);
        if (bpf_timer_start(&slot->timer, cfg->timeout_ns, 0))
            bump(ST_TIMER_FAIL);
    }
    if (last) {
        if (!first)
            bpf_timer_cancel(&slot->timer);
        {
            /* a narrow packet grew: its IPv4 and UDP lengths follow (unchanged for an int32 one); the IP
             * checksum is computed once, by whichever way the packet leaves */
            u16 ulen = sizeof(struct udphdr) + sizeof(*h) + NS_LANES * 4;
            udp->len = htons(ulen);
            ip->tot_len = htons(ulen + sizeof(struct iphdr));
        }
        if (cfg->forward)
            return ns_forward(ctx, cfg, iteration);
        if (cfg->results && !(h->flags & NS_FLAG_OVERFLOW)) {
            if (stat == ST_COMPLETE) {
                ns_count_done(cfg, iteration);
                ns_report_gap(cfg, index, iteration, tensor, chunk);
            }
            return ns_result(ctx, cfg, iteration);
        }
        ns_ip_checksum(ip);
        h->token = cfg->agg_token;
        udp->check = 0;         /* lanes changed; a zero UDP checksum over IPv4 means "none" */
        return XDP_PASS;
    }
    return stat == ST_BAD ? XDP_PASS : XDP_DROP;
}
