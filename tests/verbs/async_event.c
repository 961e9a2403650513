/* Opens a device through whatever libibverbs it is run with, says so ("opened"), and
 * waits for the context's next async event, which it prints by name
 * (ibv_event_type_str): "event IBV_EVENT_..." and exits 0.
 *
 *   async_event DEVICE
 */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s DEVICE\n", argv[0]);
		return 2;
	}
	int n;
	struct ibv_device **list = ibv_get_device_list(&n);
	struct ibv_context *ctx = NULL;
	for (int i = 0; list && i < n; i++)
		if (!strcmp(ibv_get_device_name(list[i]), argv[1]))
			ctx = ibv_open_device(list[i]);
	if (!ctx) {
		perror("ibv_open_device");
		return 1;
	}
	printf("opened\n");
	fflush(stdout);
	struct ibv_async_event event;
	if (ibv_get_async_event(ctx, &event)) {
		perror("ibv_get_async_event");
		return 1;
	}
	printf("event %s\n", ibv_event_type_str(event.event_type));
	ibv_ack_async_event(&event);
	return 0;
}
