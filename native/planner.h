/*
 * The placement planner's inner loop (kvd.planner): the step-latency model
 * of layer-wise prefetch over one shared FIFO link, and the branch and
 * bound over per-request offload distances, in C so that a batch of 16
 * requests x 32 layers plans in about a millisecond. kvd/planner/latency.py
 * is the reference the tests hold this to.
 */
#ifndef KVD_PLANNER_H
#define KVD_PLANNER_H

#include <stdint.h>

#define KVD_PLAN_NONE (-1)
#define KVD_PLAN_MAX_REQUESTS 256
#define KVD_PLAN_MAX_LAYERS 1024
#define KVD_PLAN_MAX_OPTIONS 64

struct kvd_plan_batch {
	int layers;
	int requests;
	const double *compute_s;   /* [layers] */
	const double *kv_bytes;    /* [requests], bytes of one layer of each request */
	double bandwidth_bps;
};

struct kvd_plan_result {
	int found;                 /* a placement fits the budget */
	int exact;                 /* the search finished: the placement is the best there is */
	double latency_s;
	double bound_s;            /* no placement within the budget is faster than this */
	double gpu_bytes;
	int64_t explored;          /* partial and whole placements whose latency was computed */
	int distances[KVD_PLAN_MAX_REQUESTS];
};

/* Seconds from a step's start to the end of its last layer (kvd.planner.latency.step_latency). */
double kvd_plan_step_latency(const struct kvd_plan_batch *batch, const int *distances);

/*
 * The placement of least step latency within budget_bytes, over `options`
 * (KVD_PLAN_NONE first, then distances from least to most offloaded).
 * Stops after max_nodes latency evaluations (0: no limit) with the best
 * found so far and exact = 0. Returns 0, -1 when the sizes are out of range, -2
 * when out of memory.
 */
int kvd_plan_search(const struct kvd_plan_batch *batch, const int *options, int option_count,
		    double budget_bytes, int64_t max_nodes, struct kvd_plan_result *result);

#endif
