/*
 * The placement planner's model and search; see planner.h and
 * kvd/planner/latency.py (the model) and kvd/planner/search.py (the search).
 */
#include "planner.h"

#include <stdlib.h>
#include <string.h>

static int offloaded(int distance, int layers)
{
	return distance == KVD_PLAN_NONE ? 0 : layers / (distance + 1);
}

static double request_bytes(const struct kvd_plan_batch *batch, int request, int distance)
{
	int away = offloaded(distance, batch->layers);
	/* resident layers, plus one layer of prefetch room when any is away */
	return batch->kv_bytes[request] * (batch->layers - away + (away > 0));
}

static double max2(double a, double b)
{
	return a > b ? a : b;
}

/* The offloading requests ordered by (distance, request): the order their
 * transfers requested at the same layer reach the link. */
static int fetch_order(const struct kvd_plan_batch *batch, const int *distances, int *order)
{
	int count = 0;
	for (int r = 0; r < batch->requests; r++) {
		if (distances[r] == KVD_PLAN_NONE)
			continue;
		int at = count++;
		while (at > 0 && distances[order[at - 1]] > distances[r]) {
			order[at] = order[at - 1];
			at--;
		}
		order[at] = r;
	}
	return count;
}

double kvd_plan_step_latency(const struct kvd_plan_batch *batch, const int *distances)
{
	int layers = batch->layers;
	int order[KVD_PLAN_MAX_REQUESTS];
	double arrived[KVD_PLAN_MAX_LAYERS + 1];
	int fetching = fetch_order(batch, distances, order);
	memset(arrived, 0, sizeof(double) * (size_t)(layers + 1));
	double end = 0, link_free = 0;
	for (int layer = 1; layer <= layers; layer++) {
		double start = max2(end, arrived[layer]);
		/* Request r at distance d asks for layer layer + d when layer
		 * (layer - 1) % (d + 1) == 0 starts: d layers ahead of its use. */
		for (int i = 0; i < fetching; i++) {
			int r = order[i], distance = distances[r];
			int target = layer + distance;
			if ((layer - 1) % (distance + 1) != 0 || target > layers)
				continue;
			link_free = max2(link_free, start) + batch->kv_bytes[r] / batch->bandwidth_bps;
			arrived[target] = max2(arrived[target], link_free);
		}
		end = start + batch->compute_s[layer - 1];
	}
	return end;
}

struct search {
	const struct kvd_plan_batch *batch;
	const int *options;
	int option_count;
	double budget;
	int64_t max_nodes;
	int order[KVD_PLAN_MAX_REQUESTS];               /* requests, largest first */
	double frugal_after[KVD_PLAN_MAX_REQUESTS + 1]; /* least bytes order[i:] can take */
	double full_after[KVD_PLAN_MAX_REQUESTS + 1];   /* bytes order[i:] take all on the GPU */
	double tail_compute[KVD_PLAN_MAX_LAYERS + 2];   /* [j]: compute of layers j..L (1-based) */
	/* The useful options: NONE, and distances that free memory (offloading
	 * one layer frees nothing: it needs one layer of prefetch room). */
	int useful[KVD_PLAN_MAX_OPTIONS];
	int useful_count;
	/* Per layer j, the lower convex hull of (layers freed, layers fetched
	 * for layers <= j) per byte of KV over the useful options. */
	double hull_b[KVD_PLAN_MAX_LAYERS + 1][KVD_PLAN_MAX_OPTIONS];
	double hull_c[KVD_PLAN_MAX_LAYERS + 1][KVD_PLAN_MAX_OPTIONS];
	int hull_size[KVD_PLAN_MAX_LAYERS + 1];
	double fetched_by[KVD_PLAN_MAX_LAYERS + 1];     /* [j]: assigned bytes fetched for layers <= j */
	/* The model depends on a placement only through the bytes at each
	 * distance (a class): a class's transfers asked at one layer reach the
	 * link back to back, and their layer waits for the last. sums[o] is the
	 * KV of one layer of the requests at useful[o]; ask_class lists, per
	 * layer, the classes that ask for a transfer when it starts, by
	 * distance (the link's order), from ask_start[layer]. */
	double sums[KVD_PLAN_MAX_OPTIONS];
	int ask_start[KVD_PLAN_MAX_LAYERS + 2];
	unsigned char ask_class[KVD_PLAN_MAX_OPTIONS * KVD_PLAN_MAX_LAYERS];
	double arrived[KVD_PLAN_MAX_LAYERS + 1];
	int distances[KVD_PLAN_MAX_REQUESTS];
	int chosen[KVD_PLAN_MAX_REQUESTS];              /* option index per depth */
	struct kvd_plan_result *result;
	int stopped;
};

/* The step latency of the classes in s->sums: kvd_plan_step_latency, with
 * a class's transfers at one layer as one. */
static double class_latency(struct search *s)
{
	const struct kvd_plan_batch *batch = s->batch;
	double end = 0, link_free = 0;
	memset(s->arrived, 0, sizeof(double) * (size_t)(batch->layers + 1));
	for (int layer = 1; layer <= batch->layers; layer++) {
		double start = max2(end, s->arrived[layer]);
		for (int k = s->ask_start[layer]; k < s->ask_start[layer + 1]; k++) {
			int c = s->ask_class[k];
			if (s->sums[c] <= 0)
				continue; /* an empty class moves nothing */
			int target = layer + s->useful[c];
			link_free = max2(link_free, start) + s->sums[c] / batch->bandwidth_bps;
			s->arrived[target] = max2(s->arrived[target], link_free);
		}
		end = start + batch->compute_s[layer - 1];
	}
	return end;
}

/* One latency evaluation, counted; 0 (and the search stopped) once
 * max_nodes have been spent. */
static int evaluate(struct search *s, double *latency)
{
	if (s->max_nodes && s->result->explored >= s->max_nodes) {
		s->stopped = 1;
		return 0;
	}
	s->result->explored++;
	*latency = class_latency(s);
	return 1;
}

/* The least of (layers fetched for layers <= j) per byte of KV with which
 * open requests free `benefit` layers per byte, the options mixed freely. */
static double least_fetched(const struct search *s, int layer, double benefit)
{
	const double *b = s->hull_b[layer], *c = s->hull_c[layer];
	int n = s->hull_size[layer];
	for (int i = 1; i < n; i++) {
		if (benefit <= b[i])
			return c[i - 1] + (c[i] - c[i - 1]) * (benefit - b[i - 1]) / (b[i] - b[i - 1]);
	}
	return c[n - 1];
}

/*
 * A lower bound on the step latency of any completion of the partial
 * placement at `depth`, besides the model's latency with the open requests
 * on the GPU. Whatever is fetched for layers 1..j must have crossed the
 * link before layer j starts, and layers j..L still compute after it:
 * latency >= (fetched for layers <= j) / bandwidth + compute of j..L, for
 * every j. The assigned requests' fetches are known; the open ones must
 * free what the budget lacks, and mixing their options fractionally (the
 * lower convex hull per layer) fetches no more than any real choice.
 */
static double fluid_bound(const struct search *s, int depth, double used)
{
	const struct kvd_plan_batch *batch = s->batch;
	double lacking = used + s->full_after[depth] - s->budget;
	double open = s->full_after[depth] / batch->layers; /* bytes of one layer of the open requests */
	double benefit = lacking > 0 && open > 0 ? lacking / open : 0;
	double bound = 0;
	for (int layer = 1; layer <= batch->layers; layer++) {
		double fetched = s->fetched_by[layer] + (benefit > 0 ? open * least_fetched(s, layer, benefit) : 0);
		double t = fetched / batch->bandwidth_bps + s->tail_compute[layer];
		bound = t > bound ? t : bound;
	}
	return bound;
}

static void note_fetches(struct search *s, int request, int distance, double sign)
{
	if (distance == KVD_PLAN_NONE)
		return;
	double kv = sign * s->batch->kv_bytes[request];
	for (int layer = 1; layer <= s->batch->layers; layer++)
		s->fetched_by[layer] += kv * (layer / (distance + 1));
}

/* The search's distances as the best placement so far. */
static void keep(struct search *s, double latency, double used)
{
	struct kvd_plan_result *result = s->result;
	result->found = 1;
	result->latency_s = latency;
	result->gpu_bytes = used;
	memcpy(result->distances, s->distances, sizeof(int) * (size_t)s->batch->requests);
}

static void descend(struct search *s, int depth, double used)
{
	const struct kvd_plan_batch *batch = s->batch;
	struct kvd_plan_result *result = s->result;
	double latency;
	if (s->stopped || used + s->frugal_after[depth] > s->budget)
		return;
	if (result->found && fluid_bound(s, depth, used) >= result->latency_s)
		return;
	if (!evaluate(s, &latency) || (result->found && latency >= result->latency_s))
		return;
	if (depth == batch->requests) {
		keep(s, latency, used);
		return;
	}
	int request = s->order[depth];
	double kv = batch->kv_bytes[request];
	/* Requests of equal size are interchangeable: try their distances in
	 * one order only (never less offloaded than the equal one before). */
	int first = 0;
	if (depth > 0 && batch->kv_bytes[s->order[depth - 1]] == kv)
		first = s->chosen[depth - 1];
	for (int o = first; o < s->useful_count && !s->stopped; o++) {
		int distance = s->useful[o];
		s->distances[request] = distance;
		s->chosen[depth] = o;
		s->sums[o] += kv; /* whole bytes: adding and taking back is exact */
		note_fetches(s, request, distance, 1);
		descend(s, depth + 1, used + request_bytes(batch, request, distance));
		note_fetches(s, request, distance, -1);
		s->sums[o] -= kv;
	}
	s->distances[request] = KVD_PLAN_NONE;
}

/* The lower convex hull of (layers freed, layers fetched for layers <= j)
 * over the useful options, by freed layers (monotone chain). */
static void build_hull(struct search *s, int layer)
{
	int layers = s->batch->layers, n = 0;
	double *b = s->hull_b[layer], *c = s->hull_c[layer];
	for (int o = 0; o < s->useful_count; o++) {
		int distance = s->useful[o];
		double freed = distance == KVD_PLAN_NONE ? 0 : offloaded(distance, layers) - 1;
		double fetched = distance == KVD_PLAN_NONE ? 0 : layer / (distance + 1);
		/* options come by freed layers, increasing: pop points above the chord */
		while (n >= 2 && (b[n - 1] - b[n - 2]) * (fetched - c[n - 2]) <= (c[n - 1] - c[n - 2]) * (freed - b[n - 2]))
			n--;
		b[n] = freed;
		c[n] = fetched;
		n++;
	}
	s->hull_size[layer] = n;
}

/* Per layer, the classes whose transfers are asked for when it starts, by
 * distance (kvd_plan_step_latency's order), for class_latency. */
static void build_asks(struct search *s)
{
	int layers = s->batch->layers, count = 0, k = 0;
	int by_distance[KVD_PLAN_MAX_OPTIONS];
	for (int o = 1; o < s->useful_count; o++) {
		int at = count++;
		while (at > 0 && s->useful[by_distance[at - 1]] > s->useful[o]) {
			by_distance[at] = by_distance[at - 1];
			at--;
		}
		by_distance[at] = o;
	}
	for (int layer = 1; layer <= layers; layer++) {
		s->ask_start[layer] = k;
		for (int i = 0; i < count; i++) {
			int d = s->useful[by_distance[i]];
			if ((layer - 1) % (d + 1) == 0 && layer + d <= layers)
				s->ask_class[k++] = (unsigned char)by_distance[i];
		}
	}
	s->ask_start[layers + 1] = k;
}

static void prepare(struct search *s)
{
	const struct kvd_plan_batch *batch = s->batch;
	int count = batch->requests;
	for (int r = 0; r < count; r++) {
		int at = r;
		while (at > 0 && batch->kv_bytes[s->order[at - 1]] < batch->kv_bytes[r]) {
			s->order[at] = s->order[at - 1];
			at--;
		}
		s->order[at] = r;
		s->distances[r] = KVD_PLAN_NONE;
	}
	s->frugal_after[count] = s->full_after[count] = 0;
	for (int i = count - 1; i >= 0; i--) {
		int r = s->order[i];
		double least = request_bytes(batch, r, s->options[0]);
		for (int o = 1; o < s->option_count; o++) {
			double bytes = request_bytes(batch, r, s->options[o]);
			least = bytes < least ? bytes : least;
		}
		s->frugal_after[i] = s->frugal_after[i + 1] + least;
		s->full_after[i] = s->full_after[i + 1] + request_bytes(batch, r, KVD_PLAN_NONE);
	}
	s->tail_compute[batch->layers + 1] = 0;
	for (int layer = batch->layers; layer >= 1; layer--)
		s->tail_compute[layer] = s->tail_compute[layer + 1] + batch->compute_s[layer - 1];
	s->useful_count = 0;
	for (int o = 0; o < s->option_count; o++) {
		if (s->options[o] == KVD_PLAN_NONE || offloaded(s->options[o], batch->layers) >= 2)
			s->useful[s->useful_count++] = s->options[o];
	}
	for (int layer = 1; layer <= batch->layers; layer++)
		build_hull(s, layer);
	build_asks(s);
}

/* The answer's latency and bytes computed afresh per request (the search
 * compared class sums, equal up to rounding). */
static void finish(struct search *s, struct kvd_plan_result *result, double root_bound)
{
	const struct kvd_plan_batch *batch = s->batch;
	result->exact = !s->stopped;
	if (result->found) {
		result->latency_s = kvd_plan_step_latency(batch, result->distances);
		result->gpu_bytes = 0;
		for (int r = 0; r < batch->requests; r++)
			result->gpu_bytes += request_bytes(batch, r, result->distances[r]);
	}
	result->bound_s = result->exact ? result->latency_s : root_bound;
}

int kvd_plan_search(const struct kvd_plan_batch *batch, const int *options, int option_count,
		    double budget_bytes, int64_t max_nodes, struct kvd_plan_result *result)
{
	if (batch->requests < 0 || batch->requests > KVD_PLAN_MAX_REQUESTS || batch->layers < 1 ||
	    batch->layers > KVD_PLAN_MAX_LAYERS || option_count < 1 || option_count > KVD_PLAN_MAX_OPTIONS)
		return -1;
	struct search *s = calloc(1, sizeof(*s)); /* the hulls make it too large for a thread's stack */
	if (s == NULL)
		return -2;
	memset(result, 0, sizeof(*result));
	s->batch = batch;
	s->options = options;
	s->option_count = option_count;
	s->budget = budget_bytes;
	s->max_nodes = max_nodes;
	s->result = result;
	prepare(s);
	double root = fluid_bound(s, 0, 0), kept = s->tail_compute[1];
	if (s->full_after[0] <= s->budget) {
		/* everything fits: all on the GPU is as fast as a step gets */
		double latency;
		if (evaluate(s, &latency))
			keep(s, latency, s->full_after[0]);
	} else {
		descend(s, 0, 0);
	}
	finish(s, result, root > kept ? root : kept);
	free(s);
	return 0;
}
